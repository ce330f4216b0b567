"""Load the base model in 4-bit (nf4, double quant) with a LoRA adapter (the tokenizer: ``qlora_train.tokenizer``)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from qlora_train.config import Config, ModelConfig
from qlora_train.errors import ModelLoadError

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CUDA_ONLY_OPTIMIZERS = ("paged_", "8bit", "bnb")


@dataclass(frozen=True)
class Runtime:
    """Where and how this process computes."""

    device: str  # "cuda" or "cpu"
    local_rank: int
    compute_dtype: torch.dtype
    optim: str
    bf16: bool
    fp16: bool
    note: str  # one log line saying what was chosen and why

    @property
    def device_map(self) -> dict:
        """The whole model on this process's device (``from_pretrained(device_map=...)``)."""
        return {"": self.local_rank} if self.device == "cuda" else {"": "cpu"}


def resolve_runtime(cfg: Config) -> Runtime:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        dtype = DTYPES[cfg.model.compute_dtype]
        if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            dtype = torch.float16
        return Runtime("cuda", local_rank, dtype, cfg.train.optim, dtype is torch.bfloat16, dtype is torch.float16,
                       f"CUDA: compute dtype {dtype}, optimizer {cfg.train.optim}")
    optim = cfg.train.optim
    if any(tag in optim for tag in CUDA_ONLY_OPTIMIZERS):
        optim = "adamw_torch"
    note = (f"no CUDA device: training on CPU in float32 with {optim}"
            + (f" (config asked for {cfg.train.optim}, which needs CUDA)" if optim != cfg.train.optim else ""))
    return Runtime("cpu", local_rank, torch.float32, optim, False, False, note)


def load_model_config(cfg: ModelConfig):
    """The model's ``config.json`` alone (no weights): what the setup checks read before anything loads."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(f"cannot load the model config of {cfg.name_or_path}: {' '.join(str(exc).split())}") \
            from None


def quantization_config(m: ModelConfig, compute_dtype: torch.dtype):
    """The bitsandbytes config training loads the base with (4-bit nf4 with double quantisation, or 8-bit),
    or None for a 16-bit base."""
    from transformers import BitsAndBytesConfig

    if m.load_in_4bit:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype)
    if m.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def load_base_model(m: ModelConfig, runtime: Runtime, *, quantized: bool = True):
    """The base model on this process's device in ``runtime.compute_dtype``: quantised as configured
    (``quantized``, as training loads it) or with its own weights unquantised (``quantized=False``)."""
    from transformers import AutoModelForCausalLM

    quant = quantization_config(m, runtime.compute_dtype) if quantized else None
    kwargs = dict(quantization_config=quant, dtype=runtime.compute_dtype, device_map=runtime.device_map,
                  trust_remote_code=m.trust_remote_code)
    if m.attn_implementation:
        kwargs["attn_implementation"] = m.attn_implementation
    try:
        return AutoModelForCausalLM.from_pretrained(m.name_or_path, **kwargs)
    except OSError as exc:
        raise ModelLoadError(f"cannot load the model {m.name_or_path}: {' '.join(str(exc).split())}") from None


def load_model(cfg: Config, runtime: Runtime):
    """Base model (quantised as configured) prepared for k-bit training, wrapped in a peft LoRA adapter."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = load_base_model(cfg.model, runtime)
    gc = cfg.train.gradient_checkpointing
    gc_kwargs = {"use_reentrant": False}
    if cfg.model.load_in_4bit or cfg.model.load_in_8bit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gc,
                                                gradient_checkpointing_kwargs=gc_kwargs)
    elif gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
    lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=cfg.lora.target_modules, modules_to_save=cfg.lora.modules_to_save,
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
