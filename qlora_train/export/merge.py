"""``--merge``: the trained adapter folded into the base weights -> a plain transformers model directory.

    adapter (output_dir or a checkpoint) + base in compute dtype -> merge_and_unload
        -> <merge_dir>/model*.safetensors, config.json, generation_config.json (eos: end-of-turn + eos),
           tokenizer with the training template, qlora_merge.json (what was merged, how); for a vision-language
           model its image processor too (preprocessor_config.json: the one training used), so that it serves

Which base weights the adapter is added to (``MergeOptions.base``):

- ``original`` (default): the base's own 16-bit weights, loaded unquantised in
  ``model.compute_dtype`` (float32 on CPU). The merged model is the base a
  16-bit server would load anyway, plus the adapter's update; the 4-bit
  rounding error is not baked into the result.
- ``dequantized``: the 4-bit weights training computed with, dequantised to the
  compute dtype, plus the adapter. This reproduces training's forward pass
  exactly (the adapter may have learned to offset some of the rounding error),
  at the price of shipping rounded weights in a 16-bit file.

The adapter was trained against the dequantised weights, so ``original`` moves
each layer by that layer's rounding error; for nf4 this is small and the usual
choice (peft, axolotl and Unsloth merge onto the 16-bit weights). Compare both
on your eval set when in doubt.

The directory is staged beside the destination and renamed into place
(``files.publish_dir``): it appears whole or not at all.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from qlora_train.config import Config
from qlora_train.export.adapter import ExportError, find_adapter, fit_base_to_adapter, trained_tokenizer
from qlora_train.export.stop_tokens import eos_ids, serving_generation_config, stop_tokens
from qlora_train.files import fresh_dir, publish_dir, write_atomic

log = logging.getLogger(__name__)
MERGE_INFO = "qlora_merge.json"  # marks a directory written by --merge (and says from what)
OTHER_FILES_BYTES = 256 * 2**20  # tokenizer and config files, on top of the weights


@dataclass(frozen=True)
class MergeOptions:
    """What ``--merge`` exports and where (the CLI flags of the same names)."""

    merge_dir: str | None = None  # default: <train.output_dir>/merged
    checkpoint: str | None = None  # None: the final adapter; N, checkpoint-N, last or a path
    base: Literal["original", "dequantized"] = "original"
    max_shard_size: str = "5GB"


def merge_dir(cfg: Config, option: str | None) -> Path:
    """``--merge-dir`` or its default, ``<train.output_dir>/merged``."""
    return Path(option) if option else Path(cfg.train.output_dir) / "merged"


def merge(cfg: Config, options: MergeOptions = MergeOptions()) -> Path:
    """Merge the trained adapter into the base and write the model directory; returns its path.

    Raises ``ExportError`` (no adapter, a destination that would overwrite something else, not enough
    free disk space) before loading any weights.
    """
    from peft import PeftModel

    from qlora_train.train.model import resolve_runtime
    from qlora_train.train.resume import refusing_unsafe_files

    out = Path(cfg.train.output_dir)
    adapter_dir = find_adapter(out, options.checkpoint)
    dest = merge_dir(cfg, options.merge_dir)
    check_destination(dest, adapter_dir, out)
    runtime = resolve_runtime(cfg)
    check_free_space(dest.parent, weights_bytes(cfg.model, runtime.compute_dtype) + OTHER_FILES_BYTES)
    tokenizer = trained_tokenizer(adapter_dir, cfg.model)

    log.info("merging %s into %s (%s weights, %s)", adapter_dir, cfg.model.name_or_path, options.base,
             runtime.compute_dtype)
    base = load_merge_base(cfg, runtime, options.base)
    with refusing_unsafe_files(adapter_dir, "--merge"):
        fit_base_to_adapter(base, adapter_dir, tokenizer)  # rows for the tokens model.new_tokens added
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload(safe_merge=True)
    merged.generation_config = serving_generation_config(merged.generation_config, tokenizer)

    staging = dest.with_name(f".{dest.name}.tmp")
    try:
        fresh_dir(staging)  # made new: nothing planted at its name is written through
        merged.save_pretrained(staging, max_shard_size=options.max_shard_size)
        tokenizer.save_pretrained(staging)
        processor = image_processor(cfg, adapter_dir)
        if processor is not None:
            processor.save_pretrained(staging)
        write_atomic(staging / MERGE_INFO, json.dumps(merge_info(cfg, options, adapter_dir, runtime, merged,
                                                                 tokenizer), indent=1))
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError):  # a full disk the estimate missed, a permission: the old merge stays
            raise ExportError(f"cannot write the merged model to {dest}: {exc} ({dest} was left as it was)") from None
        raise
    publish_dir(staging, dest)
    log.info("merged model written to %s (stops at %s)", dest,
             ", ".join(tokenizer.convert_ids_to_tokens(eos_ids(merged.generation_config))))
    return dest


def image_processor(cfg: Config, adapter_dir: Path):
    """A vision-language model's image processor: the one saved with the adapter (training's), else the base's;
    None for a model whose images are not read."""
    from qlora_train.vision import load_image_processor, vision_base

    vision = vision_base(cfg.model)
    if vision is None or not vision.supported:
        return None
    saved = (adapter_dir / "preprocessor_config.json").is_file()
    return load_image_processor(cfg.model, adapter_dir if saved else None)


def load_merge_base(cfg: Config, runtime, base: str):
    """The base weights the adapter is added to: its own (``original``), or the quantised ones training
    used, dequantised to the compute dtype (``dequantized``; the same as ``original`` for a 16-bit run)."""
    from qlora_train.train.model import load_base_model

    quantized = cfg.model.load_in_4bit or cfg.model.load_in_8bit
    if base == "dequantized" and not quantized:
        log.info("--merge-base dequantized: training did not quantise the base; merging onto its own weights")
    if base == "original" or not quantized:
        return load_base_model(cfg.model, runtime, quantized=False)
    return load_base_model(cfg.model, runtime, quantized=True).dequantize(dtype=runtime.compute_dtype)


def check_destination(dest: Path, adapter_dir: Path, output_dir: Path) -> None:
    """Refuse a destination whose replacement would delete something other than an earlier merge: the
    output directory or the adapter (or a folder holding them), a file, or a non-empty directory that
    ``--merge`` did not write."""
    target = dest.resolve()
    for path in (adapter_dir.resolve(), output_dir.resolve()):
        if target == path or target in path.parents:
            raise ExportError(f"--merge-dir {dest}: would replace {path}, which holds the training outputs; "
                              "choose another directory")
    if dest.is_file():
        raise ExportError(f"--merge-dir {dest}: is a file")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / MERGE_INFO).is_file():
        raise ExportError(f"--merge-dir {dest}: exists and was not written by --merge (no {MERGE_INFO}); "
                          "remove it or choose another directory")


def weights_bytes(model_cfg, dtype) -> int:
    """Bytes the merged weights take in ``dtype``: the base's parameter count (from its config, on the
    meta device: nothing is loaded) times the dtype's size."""
    import torch
    from transformers import AutoConfig

    from qlora_train.errors import ModelLoadError
    from qlora_train.train.model import model_class
    from qlora_train.vision import vision_base

    try:
        config = AutoConfig.from_pretrained(model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(f"cannot load the model config of {model_cfg.name_or_path}: "
                             f"{' '.join(str(exc).split())}") from None
    with torch.device("meta"):
        model = model_class(vision_base(model_cfg)).from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def check_free_space(folder: Path, needed: int) -> None:
    """``ExportError`` when the filesystem of ``folder`` has less than ``needed`` bytes free."""
    probe = folder
    while not probe.exists():  # the destination's parent may not exist yet
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise ExportError(f"not enough disk space in {probe}: the merged model needs about {needed / 2**30:.2f} "
                          f"GiB, {free / 2**30:.2f} GiB are free (free some, or pass --merge-dir on another disk)")


def merge_info(cfg: Config, options: MergeOptions, adapter_dir: Path, runtime, merged, tokenizer) -> dict:
    """What ``qlora_merge.json`` records: the adapter, the base and how they were merged, and where the
    model stops."""
    state = adapter_dir / "trainer_state.json"
    step = json.loads(state.read_text()).get("global_step") if state.is_file() else None
    return {
        "adapter": str(adapter_dir), "global_step": step, "base_model": cfg.model.name_or_path,
        "merge_base": options.base, "dtype": str(runtime.compute_dtype).removeprefix("torch."),
        "chat_template_kwargs": baked_kwargs(tokenizer),
        "eos_token_id": eos_ids(merged.generation_config),
        "eos_tokens": tokenizer.convert_ids_to_tokens(eos_ids(merged.generation_config)),
        "stop_strings": list(stop_tokens(tokenizer).strings),
        "merged_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def baked_kwargs(tokenizer) -> dict:
    """The ``chat_template_kwargs`` baked into the tokenizer's template (``{}`` when none)."""
    from qlora_train.chat_templates import split_template_kwargs

    template = tokenizer.chat_template
    return split_template_kwargs(template)[0] if isinstance(template, str) else {}
