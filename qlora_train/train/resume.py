"""What a training run does with the output directory it finds: start, resume its own checkpoints, or refuse.

    state = read_output_dir(cfg.train.output_dir)            # checkpoints, a finished run, the recorded config
    decision = decide(state, run_fingerprint(cfg), resume=cfg.train.resume_from_checkpoint, overwrite=False)
    decision.action, decision.checkpoint, decision.line      # "resume", ".../checkpoint-4", "resuming from ..."

The rule (``train.resume_from_checkpoint: auto``, the default), so that a run killed and started again with the same
command continues instead of starting over, and a run never writes over another one without being told to:

- the directory holds checkpoints of the same config (``run_fingerprint.json`` records it) and no finished run:
  resume from the newest complete checkpoint, said in one line;
- it holds a finished run (``training_complete.json``; or a final adapter with no checkpoints beside it), or
  checkpoints of another config, or checkpoints whose config was not recorded: refuse (exit 2) in one line saying
  why and what to do, naming ``--overwrite``;
- nothing to resume (absent, empty, or only what ``--stats-only`` / ``--preprocess`` / a run stopped before its
  first checkpoint wrote): start at step 0.

``--overwrite`` removes the run found there (checkpoints, final adapter, marker, fingerprint) and starts at step 0;
a checkpoint path in ``train.resume_from_checkpoint`` resumes from it as asked, with no check (the way to continue
a run with a changed config, e.g. more ``max_steps``).

A checkpoint without a readable ``trainer_state.json`` (the Trainer writes it last) was cut short, e.g. by SIGKILL
while saving: it is skipped, and removed when the run starts. ``decide`` is pure; ``read_output_dir`` only reads;
``prepare_output_dir`` (rank 0, once the data and the model are ready) is the only writer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from qlora_train.errors import UsageError

log = logging.getLogger("qlora_train")
COMPLETE_MARKER = "training_complete.json"
FINGERPRINT_FILE = "run_fingerprint.json"
STAGING_DIR = ".final.tmp"
FORMAT = 1  # of run_fingerprint.json
# train keys that change what a run logs, saves or where, or how fast and in how much memory it computes, not the
# weights it trains: a run may resume with other values of them
UNFINGERPRINTED_TRAIN = ("output_dir", "resume_from_checkpoint", "report_to", "logging_steps", "save_steps",
                         "save_total_limit", "eval_steps", "per_device_eval_batch_size", "dataloader_num_workers",
                         "gradient_checkpointing", "fused_loss", "fsdp_cpu_offload")
MODEL_PATH_KEYS = ("name_or_path", "tokenizer", "adapter_path", "chat_template")
# what --overwrite removes besides the checkpoints: what a finished run adds that says "finished" or "this run"
FINAL_RUN_FILES = (COMPLETE_MARKER, FINGERPRINT_FILE, "adapter_config.json", "adapter_model.safetensors",
                   "adapter_model.bin", "trainer_state.json", "loss_history.json")
Action = Literal["start", "resume", "refuse"]


# --- the fingerprint ---


AGENT_KEYS = ("tools", "max_turns", "tool_timeout_s", "tool_max_chars", "tool_call_format", "malformed_call_reward",
              "guided_first_call")


def run_fingerprint(cfg) -> dict:
    """``Config`` -> ``{"format", "fingerprint": hex, "config": {...}}``: the resolved config minus what does not
    change the trained weights (``UNFINGERPRINTED_TRAIN``; the data keys the prepared data's fingerprint leaves
    out), local paths written as ``data.prepared.portable_path`` writes them."""
    from qlora_train.data.prepared import data_identity, portable_path  # the datasets stack: only when training

    model = cfg.model.model_dump(mode="json")
    for key in MODEL_PATH_KEYS:
        if isinstance(model[key], str) and Path(model[key]).exists():
            model[key] = portable_path(model[key])
    identity = {"model": model, "lora": cfg.lora.model_dump(mode="json"), "data": data_identity(cfg),
                "train": cfg.train.model_dump(mode="json", exclude=set(UNFINGERPRINTED_TRAIN))}
    if cfg.train.method == "grpo":  # what is sampled, scored and optimised (other methods' fingerprints unchanged)
        # the agent keys only with tools: a GRPO run without them keeps the fingerprint it had before they existed
        identity["rl"] = cfg.rl.model_dump(mode="json", exclude=None if cfg.rl.tools else set(AGENT_KEYS))
    text = json.dumps(identity, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return {"format": FORMAT, "fingerprint": hashlib.blake2b(text.encode(), digest_size=16).hexdigest(),
            "config": identity}


# --- what the directory holds ---


@dataclass(frozen=True)
class OutputDirState:
    """What a training run finds in its output directory (``read_output_dir``)."""

    path: str
    checkpoints: tuple[int, ...] = ()  # steps of the complete checkpoint-N folders, ascending
    incomplete: tuple[str, ...] = ()  # names of checkpoint-N folders cut short (no readable trainer_state.json)
    finished_step: int | None = None  # training_complete.json's global_step (-1: unreadable)
    adapter: bool = False  # adapter_config.json at the top: a final adapter was published
    saved: dict | None = None  # run_fingerprint.json, when readable
    links: tuple[str, ...] = ()  # names of checkpoint-N entries that are symbolic links (never followed)

    def checkpoint(self, step: int) -> str:
        return str(Path(self.path) / f"checkpoint-{step}")

    @property
    def finished(self) -> bool:
        """A finished run: its marker, or a final adapter with no checkpoint beside it (the marker is written just
        after the adapter; runs from before the marker). An adapter beside checkpoints is an earlier run's, which
        a later one into the directory started over (``export.adapter`` says so too)."""
        return self.finished_step is not None or self.adapter and not self.checkpoints

    @property
    def holds_a_run(self) -> bool:
        return bool(self.checkpoints or self.incomplete or self.finished or self.adapter)


def read_output_dir(path: str | Path) -> OutputDirState:
    """``train.output_dir`` -> what it holds; an absent directory holds nothing. Only reads."""
    out = Path(path)
    if not out.is_dir():
        return OutputDirState(str(out))
    complete, incomplete = [], []
    named = [p for p in out.glob("checkpoint-*") if p.name.removeprefix("checkpoint-").isdigit()]
    links = tuple(sorted(p.name for p in named if p.is_symlink()))
    found = [(int(p.name.removeprefix("checkpoint-")), p) for p in named if p.is_dir() and not p.is_symlink()]
    for step, p in sorted(found):
        (complete if _readable_json(p / "trainer_state.json") is not None else incomplete).append((step, p.name))
    marker = out / COMPLETE_MARKER
    finished_step = None
    if marker.is_file():
        finished_step = (_readable_json(marker) or {}).get("global_step", -1)
    return OutputDirState(str(out), tuple(s for s, _ in complete), tuple(n for _, n in incomplete), finished_step,
                          (out / "adapter_config.json").is_file(), _readable_json(out / FINGERPRINT_FILE), links)


def _readable_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def last_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir``, or None (cut-short ones skipped, with a warning)."""
    state = read_output_dir(output_dir)
    newer = [name for name in state.incomplete
             if not state.checkpoints or int(name.removeprefix("checkpoint-")) > state.checkpoints[-1]]
    for name in reversed(newer):
        log.warning("skipping incomplete checkpoint %s (no readable trainer_state.json)", Path(output_dir) / name)
    return state.checkpoint(state.checkpoints[-1]) if state.checkpoints else None


# --- the decision ---


@dataclass(frozen=True)
class Decision:
    """What the run does: ``start`` at step 0, ``resume`` from ``checkpoint``, or ``refuse`` (``line`` says why and
    what to do). ``clear``: remove the run found in the directory first (``--overwrite``)."""

    action: Action
    line: str
    checkpoint: str | None = None
    clear: bool = False
    remove: tuple[str, ...] = ()  # cut-short checkpoint folders to remove before training


def decide(state: OutputDirState, now: dict, *, resume: str, overwrite: bool) -> Decision:
    """The directory's state, this run's fingerprint (``run_fingerprint``), ``train.resume_from_checkpoint``
    (``auto`` or a checkpoint path) and ``--overwrite`` -> what to do (the rule in the module doc)."""
    out = state.path
    if state.links:  # the Trainer's own clean-up (save_total_limit) and --overwrite would delete through them
        return Decision("refuse", f"{Path(out) / state.links[0]} is a symbolic link: a run neither resumes from "
                        "nor deletes anything through a link; remove the link (its target is left as it is), or "
                        "name the checkpoint it points to in train.resume_from_checkpoint")
    if resume != "auto":  # a checkpoint path, resumed as asked
        if overwrite and _inside(resume, out):
            return Decision("refuse", f"--overwrite would remove {resume}, the checkpoint "
                            "train.resume_from_checkpoint names: drop one of the two")
        return Decision("resume", f"resuming from {resume} (train.resume_from_checkpoint)", resume, clear=overwrite)
    if overwrite:
        line = f"--overwrite: removing {_describe(state)} in {out}; starting at step 0" if state.holds_a_run \
            else "starting at step 0"
        return Decision("start", line, clear=True)
    if state.finished:
        step = f" (step {state.finished_step})" if state.finished_step not in (None, -1) else ""
        return Decision("refuse", f"{out} holds a finished run{step}: train into another train.output_dir, or add "
                        "--overwrite to train again from step 0 (removes its checkpoints and adapter)")
    if not state.checkpoints:
        note = f" ({', '.join(state.incomplete)} cut short, removed)" if state.incomplete else ""
        return Decision("start", f"starting at step 0{note}", remove=state.incomplete)
    newest = f"checkpoint-{state.checkpoints[-1]}"
    if state.saved is None:
        return Decision("refuse", f"{out} holds checkpoints (up to {newest}) of a run whose config was not recorded "
                        f"(no {FINGERPRINT_FILE}): resume one with train.resume_from_checkpoint: "
                        f"{state.checkpoint(state.checkpoints[-1])}, or add --overwrite to start over (removes them)")
    if state.saved.get("fingerprint") != now["fingerprint"]:
        return Decision("refuse", f"{out} holds checkpoints (up to {newest}) of another config "
                        f"({_config_difference(state.saved.get('config'), now['config'])}): train into another "
                        "train.output_dir, run that config to resume them, or add --overwrite to start over "
                        "(removes them)")
    step = state.checkpoints[-1]
    return Decision("resume", f"resuming from {newest} (step {step}) in {out}: the same config as its "
                    f"checkpoints (fingerprint {now['fingerprint'][:12]})", state.checkpoint(step),
                    remove=tuple(n for n in state.incomplete if int(n.removeprefix("checkpoint-")) > step))


def _inside(path: str, directory: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(directory)]) == os.path.abspath(directory)


def _describe(state: OutputDirState) -> str:
    parts = []
    if state.finished:
        parts.append("a finished run")
    if state.checkpoints or state.incomplete:
        steps = [f"checkpoint-{s}" for s in state.checkpoints] + list(state.incomplete)
        parts.append(", ".join(sorted(steps, key=lambda n: int(n.removeprefix("checkpoint-")))))
    if state.adapter and not state.finished:
        parts.append("an earlier run's adapter")
    return " and ".join(parts)


def _config_difference(saved: dict | None, now: dict) -> str:
    """The first differing key path, ``"train.learning_rate: 0.0002 there, 0.001 now"`` (+ how many more)."""
    from qlora_train.data.prepared import differing_keys

    if not isinstance(saved, dict):
        return "its fingerprint differs"
    lines = differing_keys(saved, now, then="there")
    if not lines:
        return "its fingerprint differs"
    more = f"; {len(lines) - 1} more" if len(lines) > 1 else ""
    return f"{lines[0]}{more}"


# --- reading a checkpoint ---


@contextlib.contextmanager
def refusing_unsafe_files(folder: str | Path, where: str):
    """Read files of ``folder`` (a checkpoint, an adapter) inside: a file that torch's weights-only loader or
    safetensors refuses (a pickle that would run code, a file that is not tensors at all) -> ``UsageError`` (exit 2)
    in one line naming ``where``, the file and why, without torch's advice to load it again unsafely."""
    try:
        yield
    except Exception as exc:
        why = _refused_why(exc)
        if why is None:
            raise
        name = _file_read(exc, Path(folder))
        raise UsageError(f"{where}: {name or f'a file in {folder}'} is not a tensor file ({why}): it was refused "
                         "unread (checkpoints are read as tensors only, never as code); remove it, or use another "
                         "checkpoint") from None


# the sentences of torch's message that advise loading the file anyway (unsafely), or say nothing of the file
_UNSAFE_HINTS = ("weights_only", "Weights only load failed", "arbitrary code", "trusted source", "safe_globals",
                 "allowlist", "Check the documentation", "file an issue")


def _refused_why(exc: BaseException) -> str | None:
    """Why torch's weights-only loader or safetensors refused a file (their own words, less torch's hint), or
    None for any other exception."""
    import pickle

    from safetensors import SafetensorError

    text = " ".join(str(exc).split())
    if isinstance(exc, pickle.UnpicklingError):
        pieces = (p.strip().removeprefix("WeightsUnpickler error:").strip()
                  for p in re.split(r"\n+|(?<=\.) (?=[A-Z])", str(exc)))
        said = " ".join(p for p in pieces if p and not any(hint in p for hint in _UNSAFE_HINTS))
        return said.rstrip(".") or "not a tensor pickle"
    if isinstance(exc, SafetensorError):
        return f"safetensors: {text[:200]}"
    if isinstance(exc, RuntimeError) and "PytorchStreamReader" in text:
        return text[:200]
    return None


def _file_read(exc: BaseException, folder: Path) -> str | None:
    """The file inside ``folder`` that the failing read was reading: the innermost path inside it that a frame of
    the traceback holds (torch.load's ``f``, safetensors' ``filename``), or None."""
    found, tb, top = None, exc.__traceback__, os.path.realpath(folder)
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, os.PathLike) or isinstance(value, str) and len(value) < 4096 and "\0" not in value:
                path = os.path.realpath(os.fspath(value))
                if path.startswith(top + os.sep) and os.path.isfile(path):
                    found = os.fspath(value)
        tb = tb.tb_next
    return found


# --- acting on it ---


def prepare_output_dir(decision: Decision, now: dict, out: Path) -> None:
    """Rank 0, before training: remove what the decision says (the run found, with ``--overwrite``; cut-short
    checkpoints), and record this run's fingerprint (``run_fingerprint.json``)."""
    from qlora_train.files import remove
    from qlora_train.output_dir import read_marker

    out.mkdir(parents=True, exist_ok=True)
    if decision.clear:  # only what our runs write, nothing through a link (a link itself is unlinked)
        for path in out.glob("checkpoint-*"):
            if path.name.removeprefix("checkpoint-").isdigit():
                remove(path)
        remove(out / STAGING_DIR)
        published = read_marker(out).get("published", [])
        for name in {*FINAL_RUN_FILES, *(n for n in published if _plain_name(n))}:
            remove(out / name)
    for name in decision.remove:
        remove(out / name)
    (out / COMPLETE_MARKER).unlink(missing_ok=True)  # this run is not complete until it says so
    from qlora_train.files import write_atomic

    write_atomic(out / FINGERPRINT_FILE, json.dumps(now, indent=1, ensure_ascii=False))


def _plain_name(name) -> bool:
    """A name the marker lists as published: an entry right inside the folder, not the marker or the lock."""
    from qlora_train.output_dir import LOCK_FILE, MARKER_FILE

    return (isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..", MARKER_FILE, LOCK_FILE)
            and "/" not in name and "\\" not in name)


def agree(decision: Decision) -> Decision:
    """Under ``torchrun`` every rank takes rank 0's decision (its view of the directory), so that all start, resume
    from the same checkpoint, or refuse together; one process: unchanged."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decision
    box = [decision]
    dist.broadcast_object_list(box, src=0)
    return box[0]
