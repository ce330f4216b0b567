"""How several processes share a run (``train.distributed``): DDP, each rank holding the whole 4-bit model, or
FSDP2 (torch ``fully_shard`` through accelerate), each rank holding 1/N of it (docs/distributed.md).

FSDP can shard a bitsandbytes 4-bit weight only when its packed bytes are stored in a float dtype
(``bnb_4bit_quant_storage``), and FSDP's mixed-precision ``param_dtype`` must be that same dtype: FSDP casts what
it gathers to ``param_dtype``, which turns packed nf4 bytes stored as float32 into garbage when cast to bfloat16.
uint8 storage is not sharded at all (accelerate leaves such weights whole on every rank, accelerate #3983).
``fsdp_setup_problem`` checks both before any weight loads; ``quant_storage_dtype`` picks the storage.

    >>> quant_storage_dtype("auto", "fsdp", torch.bfloat16)
    torch.bfloat16
    >>> quant_storage_dtype("auto", "ddp", torch.bfloat16)
    torch.uint8
"""

from __future__ import annotations

import logging
import os
from typing import get_args

import torch
from transformers import TrainerCallback

from qlora_train.config import QuantStorage
from qlora_train.errors import ConfigError, ModelLoadError
from qlora_train.train.fused_loss import whole

log = logging.getLogger("qlora_train")
STORAGE_DTYPES = {name: getattr(torch, name) for name in get_args(QuantStorage) if name != "auto"}
# accelerate's mixed-precision names -> the param_dtype FSDP gathers in ("no": each parameter's own dtype)
MIXED_PRECISION_DTYPES = {"no": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                          "fp8": torch.bfloat16}


def quant_storage_dtype(storage: str, distributed: str, compute_dtype: torch.dtype) -> torch.dtype:
    """``model.bnb_4bit_quant_storage`` -> the dtype the packed 4-bit weights are stored in: ``auto`` is the
    compute dtype under FSDP (so that they shard) and uint8 under DDP (bitsandbytes' default)."""
    if storage == "auto":
        return compute_dtype if distributed == "fsdp" else torch.uint8
    return STORAGE_DTYPES[storage]


def fsdp_setup_problem(*, storage: torch.dtype, compute_dtype: torch.dtype, mixed_precision: str,
                       quantized: bool) -> str | None:
    """What would make FSDP shard the 4-bit weights wrongly or not at all, as one line naming the fix, or None.

    ``mixed_precision`` is accelerate's (``TrainingArguments.mixed_precision``: the compute dtype's, or the
    launcher's ``--mixed_precision`` when the compute dtype is float32); it sets FSDP's ``param_dtype``."""
    if not quantized:
        return None
    name = lambda dtype: str(dtype).removeprefix("torch.")
    if not storage.is_floating_point:
        return (f"model.bnb_4bit_quant_storage: {name(storage)} storage cannot be sharded by FSDP (each rank would "
                "keep every 4-bit weight whole, accelerate #3983); set model.bnb_4bit_quant_storage: auto")
    if storage != compute_dtype:
        return (f"model.bnb_4bit_quant_storage: {name(storage)} differs from the compute dtype {name(compute_dtype)}; "
                "FSDP needs the 4-bit storage dtype to equal it: set model.bnb_4bit_quant_storage: auto")
    param_dtype = MIXED_PRECISION_DTYPES.get(mixed_precision)
    if param_dtype is not None and param_dtype != storage:
        return (f"mixed precision {mixed_precision}: FSDP would gather the {name(storage)}-stored 4-bit weights in "
                f"{name(param_dtype)}, which corrupts them; launch without --mixed_precision (and mixed_precision: "
                "'no' in an accelerate config): model.compute_dtype sets it")
    return None


def launcher_problem(distributed: str, env: dict | None = None) -> str | None:
    """A launch that disagrees with ``train.distributed``, as one line naming the fix, or None: an accelerate
    config asking for DeepSpeed, or for FSDP with ``ddp`` (accelerate would shard the model without float 4-bit
    storage), or ``fsdp`` in a single process without a launcher."""
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true"):
        return ("the accelerate config launches DeepSpeed, which this trainer does not support with 4-bit weights; "
                "use train.distributed: fsdp (docs/distributed.md#deepspeed-zero-3)")
    if distributed == "ddp" and env.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        return ("train.distributed: ddp, but the accelerate config launches FSDP; set train.distributed: fsdp "
                "(or launch with a config without distributed_type: FSDP)")
    if distributed == "fsdp" and "LOCAL_RANK" not in env:
        return ("train.distributed: fsdp needs a launcher: torchrun --nproc_per_node N -m qlora_train.cli ... "
                "(or accelerate launch --config_file configs/accelerate/fsdp2.yaml -m qlora_train.cli ...)")
    return None


def check_distributed_setup(cfg, runtime, env: dict | None = None) -> None:
    """``ConfigError`` (exit 2) with one line naming the fix when the launch or the 4-bit storage would not shard
    as ``train.distributed`` says (``launcher_problem``, ``fsdp_setup_problem``); checked before any weight loads,
    and before ``TrainingArguments`` (which fails on a DeepSpeed launch without deepspeed installed)."""
    env = os.environ if env is None else env
    # TrainingArguments.mixed_precision: the compute dtype's, else the launcher's
    mixed_precision = "bf16" if runtime.bf16 else "fp16" if runtime.fp16 else env.get("ACCELERATE_MIXED_PRECISION",
                                                                                      "no")
    problem = None
    if cfg.train.distributed == "fsdp":
        problem = fsdp_setup_problem(storage=runtime.quant_storage, compute_dtype=runtime.compute_dtype,
                                     mixed_precision=mixed_precision, quantized=cfg.model.load_in_4bit)
    if cfg.train.fsdp_cpu_offload and runtime.device != "cuda":
        problem = problem or ("train.fsdp_cpu_offload: moves GPU memory to the CPU; without a CUDA device there is "
                              "nothing to offload: set it to false")
    problem = problem or launcher_problem(cfg.train.distributed, env)
    if problem:
        raise ConfigError([problem])


def check_new_tokens(distributed: str, new_tokens) -> None:
    """``ConfigError`` when ``model.new_tokens`` adds tokens under FSDP: sharding peft's trainable token rows (a
    wrapper around the embedding and the head) fails in ``fully_shard`` (torch 2.13, peft 0.21). Checked once the
    tokenizer has said which tokens are new, before any weight loads."""
    if distributed == "fsdp" and new_tokens:
        raise ConfigError(["model.new_tokens: adding tokens is not available with train.distributed: fsdp (peft's "
                           "trainable token rows do not shard); use train.distributed: ddp"])


def fsdp_config(cpu_offload: bool) -> dict:
    """``TrainingArguments.fsdp_config`` of an FSDP2 run: each decoder layer its own unit (the model's
    ``_no_split_modules``), parameters resharded after forward; a checkpoint's model and optimizer state saved
    sharded (each rank writes its part of the adapter's, ``torch.distributed.checkpoint``; what resume reads),
    beside the whole adapter ``FsdpTrainer.save_model`` writes."""
    return {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "reshard_after_forward": True,
            "state_dict_type": "SHARDED_STATE_DICT", "cpu_ram_efficient_loading": False, "cpu_offload": cpu_offload}


def local_and_full_bytes(model, module_type: str = "Linear4bit") -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole weights) of the 4-bit weights in ``model``: measured from the
    parameters (a sharded one is a ``DTensor``: its local shard against its global shape)."""
    local = full = 0
    for module in model.modules():
        if type(module).__name__ != module_type:
            continue
        weight = module.weight
        size = weight.element_size()
        full += weight.numel() * size
        local += (weight.to_local() if hasattr(weight, "to_local") else weight).numel() * size
    return local, full


class ShardReport(TrainerCallback):
    """At train begin (the model is sharded by then): logs the 4-bit weight bytes each rank holds, measured, and
    stops the run when FSDP left them whole on several ranks (axolotl PR #2992: "little to no memory savings")."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import torch.distributed as dist

        per_rank = [local_and_full_bytes(model)]
        if dist.is_initialized():
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, local_and_full_bytes(model))
        full = per_rank[0][1]
        if not full:
            return
        log.info("fsdp: 4-bit weight bytes per rank %s of %s unsharded",
                 ", ".join(f"{local:,} ({local / full:.1%})" for local, _ in per_rank), f"{full:,}")
        if len(per_rank) > 1 and max(local for local, _ in per_rank) == full:
            raise ModelLoadError("train.distributed: fsdp, but FSDP left the 4-bit weights whole on every rank; "
                                 "see docs/distributed.md#known-problems")


def full_trained_state(model) -> dict[str, torch.Tensor]:
    """The parameters that train (the adapter), each gathered whole on every rank, on CPU: what the adapter's
    files are written from (peft keeps the adapter's keys of it). A collective: every rank calls it. The frozen
    4-bit base is never gathered."""
    return {name: whole(param).detach().cpu() for name, param in model.named_parameters() if param.requires_grad}


class FsdpTrainer:
    """Mixed in before a ``Trainer`` class under ``train.distributed: fsdp``:

    - on CPU (gloo), gives accelerate's FSDP2 path the Trainer's FSDP plugin: accelerate turns FSDP on for
      accelerators only and on CPU would silently train DDP instead. The sharding stays accelerate's
      ``fsdp2_prepare_model`` (torch ``fully_shard``); this only keeps the CPU state from dropping the plugin, so
      that the CPU tests run what a GPU run does. Nothing changes where FSDP is on already (CUDA);
    - saves the adapter gathered from the shards (``full_trained_state``) as a normal peft adapter, instead of the
      Trainer's full state dict of the whole model (the 4-bit base too, gathered to rank 0 at every checkpoint).
    """

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if state.distributed_type == DistributedType.MULTI_CPU:
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            if state.mixed_precision != "no":
                plugin.set_mixed_precision(state.mixed_precision)
            state.fsdp_plugin, state.distributed_type = plugin, DistributedType.FSDP
            self.is_fsdp_enabled = True

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        state = full_trained_state(self.model)
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state)


def with_fsdp(trainer_class: type) -> type:
    """``trainer_class`` with ``FsdpTrainer`` mixed in."""
    return type(f"Fsdp{trainer_class.__name__}", (FsdpTrainer, trainer_class), {})
