"""Which trained adapter to export, and the tokenizer training used with it.

    >>> find_adapter("outputs/run")                    # the final adapter
    PosixPath('outputs/run')
    >>> find_adapter("outputs/run", "checkpoint-30")   # or "30", "last", or any checkpoint path
    PosixPath('outputs/run/checkpoint-30')

Both the final outputs and each ``checkpoint-N`` hold the adapter and the
tokenizer with the chat template training rendered with (the Trainer saves the
tokenizer into every checkpoint), so either can be exported alone.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from qlora_train.errors import UsageError

log = logging.getLogger(__name__)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


class ExportError(UsageError):
    """What to export is missing or cannot be written (no adapter, no disk space, a bad destination):
    a usage error (exit 2), said in one line."""


def has_adapter(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and any((path / w).is_file() for w in ADAPTER_WEIGHTS)


def checkpoints(output_dir: Path) -> list[str]:
    """Names of the ``checkpoint-N`` folders of ``output_dir`` holding an adapter, oldest first."""
    found = [p for p in output_dir.glob("checkpoint-*") if p.name.removeprefix("checkpoint-").isdigit()]
    return [p.name for p in sorted(found, key=lambda p: int(p.name.removeprefix("checkpoint-"))) if has_adapter(p)]


def find_adapter(output_dir: str | Path, checkpoint: str | None = None) -> Path:
    """``train.output_dir`` (+ ``--checkpoint``) -> the folder of the adapter to export.

    ``checkpoint``: None for the final adapter; ``last`` for the newest complete
    checkpoint; ``checkpoint-N`` or ``N`` inside ``output_dir``; or a path.
    Raises ``ExportError`` naming what is there instead when there is no adapter.
    """
    from qlora_train.train.resume import COMPLETE_MARKER, last_checkpoint

    out = Path(output_dir)
    if checkpoint is None:
        if has_adapter(out):
            if not (out / COMPLETE_MARKER).is_file():
                log.warning("%s has no %s: a later run into it started and did not finish; exporting the adapter "
                            "of the earlier run", out, COMPLETE_MARKER)
            return out
        raise ExportError(_no_adapter(out))
    if checkpoint == "last":
        last = last_checkpoint(str(out))
        if last is None:
            raise ExportError(f"--checkpoint last: no complete checkpoint in {out}")
        path = Path(last)
    else:
        name = f"checkpoint-{checkpoint}" if checkpoint.isdigit() else checkpoint
        path = Path(checkpoint) if Path(checkpoint).is_dir() else out / name
    if not has_adapter(path):
        saved = checkpoints(out) if out.is_dir() else []
        where = f"checkpoints in {out}: {', '.join(saved)}" if saved else f"no checkpoint in {out}"
        raise ExportError(f"--checkpoint {checkpoint}: no adapter ({ADAPTER_CONFIG} and weights) in {path} ({where})")
    return path


def _no_adapter(out: Path) -> str:
    if not out.is_dir():
        return f"no trained adapter: train.output_dir {out} does not exist (train first)"
    saved = checkpoints(out)
    if saved:
        return (f"no final adapter in {out} (the run did not finish): export a checkpoint with --checkpoint "
                f"({', '.join(saved)}, or last), or finish training: run the training command again")
    return f"no trained adapter in {out} ({ADAPTER_CONFIG} and weights): train first"


def trained_token_rows(adapter_dir: Path) -> list[int]:
    """The embedding rows the adapter trains besides LoRA (peft's ``trainable_token_indices``: the tokens
    ``model.new_tokens`` added), sorted; empty when it trains none."""
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    indices = config.get("trainable_token_indices") or []
    rows = [i for ids in indices.values() for i in ids] if isinstance(indices, dict) else indices
    return sorted(set(rows))


def fit_base_to_adapter(base, adapter_dir: Path, tokenizer) -> None:
    """Before the adapter is applied: when it trains rows of new tokens, the base's embeddings grown to the
    saved tokenizer's length as training grew them (``fit_embeddings``); the adapter then puts the trained
    rows in. ``ExportError`` when the tokenizer lacks tokens the adapter trains."""
    from qlora_train.train.model import fit_embeddings

    rows = trained_token_rows(adapter_dir)
    if not rows:
        return
    if rows[-1] >= len(tokenizer):
        raise ExportError(f"the adapter in {adapter_dir} trains token {rows[-1]}, but its tokenizer has "
                          f"{len(tokenizer)} tokens: the tokenizer saved with it is missing or not the one it was "
                          "trained with")
    fit_embeddings(base, len(tokenizer))


def trained_tokenizer(adapter_dir: Path, model_cfg):
    """The tokenizer saved beside the adapter (the chat template and kwargs training rendered with), or
    the one the config describes when the folder has none. Warns when the config now names another
    template: the saved one is what the adapter learned."""
    from transformers import AutoTokenizer

    from qlora_train.tokenizer import load_tokenizer

    configured = load_tokenizer(model_cfg)
    if not (adapter_dir / "tokenizer_config.json").is_file():
        log.warning("no tokenizer saved in %s: using the one the config describes", adapter_dir)
        return configured
    tok = AutoTokenizer.from_pretrained(adapter_dir, trust_remote_code=model_cfg.trust_remote_code)
    if tok.chat_template != configured.chat_template:
        log.warning("the chat template saved with the adapter in %s differs from the one the config names now; "
                    "the saved one, which training used, is kept", adapter_dir)
    return tok
