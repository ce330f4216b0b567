"""Load the base model in 4-bit (nf4, double quant) with a LoRA adapter (the tokenizer: ``qlora_train.tokenizer``);
with ``model.new_tokens``, embedding rows for the new tokens, trained alone (``fit_embeddings``).

A vision-language base (``vision.vision_base``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) loads as its image-text-to-text
class with the language model quantised and its vision tower not (kept in the compute dtype), frozen unless
``lora.train_vision``: LoRA adapts the language model's linear layers only by default (``lora_exclusions``)."""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from qlora_train.config import Config, ModelConfig
from qlora_train.errors import ModelLoadError
from qlora_train.tokenizer import NO_NEW_TOKENS, NewTokens
from qlora_train.vision import VisionBase, vision_base

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CUDA_ONLY_OPTIMIZERS = ("paged_", "8bit", "bnb")
PAD_VOCABULARY_TO = 64  # embeddings grown for new tokens get a multiple of this many rows (tensor-core friendly)


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
    quant_storage: torch.dtype = torch.uint8  # what the packed 4-bit weights are stored in (train.distributed)

    @property
    def device_map(self) -> dict:
        """The whole model on this process's device (``from_pretrained(device_map=...)``)."""
        return {"": self.local_rank} if self.device == "cuda" else {"": "cpu"}


def resolve_runtime(cfg: Config) -> Runtime:
    from qlora_train.train.distributed import quant_storage_dtype

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    storage = functools.partial(quant_storage_dtype, cfg.model.bnb_4bit_quant_storage, cfg.train.distributed)
    fsdp = lambda dtype: (f", FSDP2 with 4-bit weights stored in {str(storage(dtype)).removeprefix('torch.')}"
                          if cfg.train.distributed == "fsdp" else "")
    if torch.cuda.is_available():
        dtype = DTYPES[cfg.model.compute_dtype]
        if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            dtype = torch.float16
        return Runtime("cuda", local_rank, dtype, cfg.train.optim, dtype is torch.bfloat16, dtype is torch.float16,
                       f"CUDA: compute dtype {dtype}, optimizer {cfg.train.optim}" + fsdp(dtype),
                       quant_storage=storage(dtype))
    optim = cfg.train.optim
    if any(tag in optim for tag in CUDA_ONLY_OPTIMIZERS):
        optim = "adamw_torch"
    note = (f"no CUDA device: training on CPU in float32 with {optim}"
            + (f" (config asked for {cfg.train.optim}, which needs CUDA)" if optim != cfg.train.optim else "")
            + fsdp(torch.float32))
    return Runtime("cpu", local_rank, torch.float32, optim, False, False, note, quant_storage=storage(torch.float32))


def load_model_config(cfg: ModelConfig):
    """The model's ``config.json`` alone (no weights): what the setup checks read before anything loads."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise model_load_error(exc, f"the model config of {cfg.name_or_path}") from None


def model_load_error(exc: Exception, what: str) -> ModelLoadError:
    """What transformers raised loading ``what`` -> one line; for a model whose config names its own code
    (``auto_map``) for a type transformers does not know, what ``model.trust_remote_code`` is for."""
    text = " ".join(str(exc).split())
    if "trust_remote_code" in text:
        return ModelLoadError(f"cannot load {what}: its config names its own code (auto_map) for a model type "
                              "transformers does not know, and model.trust_remote_code is false, so that code is not "
                              "run; set model.trust_remote_code: true only for a repository whose code you would run "
                              "yourself (docs/trust.md)")
    return ModelLoadError(f"cannot load {what}: {text}")


def quantization_config(m: ModelConfig, compute_dtype: torch.dtype, quant_storage: torch.dtype = torch.uint8,
                        not_quantized: tuple[str, ...] = ()):
    """The bitsandbytes config training loads the base with (4-bit nf4 with double quantisation, its packed bytes
    stored as ``quant_storage``, or 8-bit), or None for a 16-bit base. ``not_quantized``: module paths kept in the
    compute dtype besides the output head (a vision tower, ``model.visual``)."""
    from transformers import BitsAndBytesConfig

    skip = {"llm_int8_skip_modules": ["lm_head", *not_quantized]} if not_quantized else {}
    if m.load_in_4bit:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=quant_storage, **skip)
    if m.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    return None


def model_class(vision: VisionBase | None):
    """The transformers auto class a base loads with: image-text-to-text for a vision-language base whose images
    this trainer reads, else the causal LM (a vision-language base of another type trains on text as before)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision is not None and vision.supported else AutoModelForCausalLM


def load_base_model(m: ModelConfig, runtime: Runtime, *, quantized: bool = True):
    """The base model on this process's device in ``runtime.compute_dtype``: quantised as configured
    (``quantized``, as training loads it; a vision tower never) or with its own weights unquantised
    (``quantized=False``)."""
    vision = vision_base(m, strict=False)  # an unreachable hub config: the model load says why
    # the tower and, where a family has one outside it (LLaVA-OneVision, InternVL 3, Mistral 3), its projector:
    # kept unquantised
    tower = (vision.tower, "model.multi_modal_projector") if vision is not None and vision.supported else ()
    quant = quantization_config(m, runtime.compute_dtype, runtime.quant_storage, tower) if quantized else None
    kwargs = dict(quantization_config=quant, dtype=runtime.compute_dtype, device_map=runtime.device_map,
                  trust_remote_code=m.trust_remote_code)
    if m.attn_implementation:
        kwargs["attn_implementation"] = m.attn_implementation
    try:
        return model_class(vision).from_pretrained(m.name_or_path, **kwargs)
    except (OSError, ValueError) as exc:
        raise model_load_error(exc, f"the model {m.name_or_path}") from None


def fit_embeddings(model, vocab_size: int, init_from: Mapping[int, Sequence[int]] | None = None) -> None:
    """Give ``model``'s embedding, and its output head when untied, a row for each of ``vocab_size`` tokens (in
    place).

    With fewer rows, both grow to the next multiple of ``PAD_VOCABULARY_TO``, each added row the mean of the old
    rows: deterministic, so ``--merge`` and ``--generate`` rebuild what training started from. Each id of
    ``init_from`` (a new token -> the ids its text was split into before) then starts as the mean of those
    ids' rows, in the embedding and in an untied head alike. Rows of the old vocabulary stay as they were.

        >>> fit_embeddings(model, 128260, {128256: (27, 91, 318, 5011, 91, 29)})  # Llama 3 + <|im_start|>
        >>> model.get_input_embeddings().weight.shape[0]
        128320
    """
    rows = model.get_input_embeddings().weight.shape[0]
    if vocab_size > rows:
        model.resize_token_embeddings(vocab_size, pad_to_multiple_of=PAD_VOCABULARY_TO, mean_resizing=False)
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    matrices = [embedding] + ([head.weight] if head is not None and head.weight is not embedding else [])
    with torch.no_grad():
        for weight in matrices:
            if weight.shape[0] > rows:
                weight[rows:] = weight[:rows].float().mean(dim=0).to(weight.dtype)
            for new_id, pieces in (init_from or {}).items():
                weight[new_id] = weight[list(pieces)].float().mean(dim=0).to(weight.dtype)


def trainable_token_indices(model, ids: Sequence[int]) -> list[int] | dict[str, list[int]]:
    """peft's ``LoraConfig.trainable_token_indices`` for training the rows of ``ids``: the embedding's (peft
    trains a tied output head's with them), or, when the head is untied, the embedding's and the head's by
    module name: the model must learn to write the new tokens, not only to read them."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is embedding.weight:
        return list(ids)
    names = {module: name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    return {names[embedding]: list(ids), names[head]: list(ids)}


def needs_reference(cfg: Config) -> bool:
    """Whether training compares the policy with a reference model: DPO, KTO, and GRPO with ``rl.beta`` > 0."""
    return cfg.train.method in ("dpo", "kto") or (cfg.train.method == "grpo" and cfg.rl.beta > 0)


def load_model(cfg: Config, runtime: Runtime, new_tokens: NewTokens = NO_NEW_TOKENS):
    """Base model (quantised as configured) prepared for k-bit training, wrapped in a fresh peft LoRA adapter, or
    in the one ``model.adapter_path`` names (``start_from_adapter``); with ``new_tokens``, the embeddings fitted to
    them (``fit_embeddings``) and only their rows trained besides LoRA (peft's trainable tokens, not whole
    embedding matrices)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    vision = vision_base(cfg.model, strict=False)
    tower = vision.tower if vision is not None and vision.supported else None
    model = load_base_model(cfg.model, runtime)
    keep_4bit_layout(model)
    if new_tokens:
        before = model.get_input_embeddings().weight.shape[0]
        fit_embeddings(model, max(new_tokens.ids) + 1, dict(zip(new_tokens.ids, new_tokens.pieces)))
        log.info("model.new_tokens: %d tokens, embedding rows %d -> %d, each new row the mean of its pieces' rows",
                 len(new_tokens.ids), before, model.get_input_embeddings().weight.shape[0])
    gc = cfg.train.gradient_checkpointing
    gc_kwargs = {"use_reentrant": False}
    if cfg.model.load_in_4bit or cfg.model.load_in_8bit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gc,
                                                gradient_checkpointing_kwargs=gc_kwargs)
    elif gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
    if tower is not None:  # peft's k-bit preparation upcasts every 16-bit weight: the tower stays as loaded
        model.get_submodule(tower).to(runtime.compute_dtype)
    if cfg.model.adapter_path:
        model = start_from_adapter(model, cfg.model.adapter_path, with_reference=needs_reference(cfg))
    else:
        tokens = trainable_token_indices(model, new_tokens.ids) if new_tokens else None
        lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                          target_modules=cfg.lora.target_modules, modules_to_save=cfg.lora.modules_to_save,
                          trainable_token_indices=tokens, task_type="CAUSAL_LM",
                          exclude_modules=lora_exclusions(tower, cfg.lora.train_vision))
        model = get_peft_model(model, lora)
    if tower is not None:
        check_vision_tower(model, tower, cfg.lora.train_vision)
    if new_tokens:
        check_head_trains_new_rows(model)
        # peft saves whole embedding matrices with the adapter of a resized base (save_embedding_layers="auto"),
        # GBs per checkpoint; the trained rows are in the adapter, and loading fits the base as above
        model.save_pretrained = functools.partial(model.save_pretrained, save_embedding_layers=False)
    return model


def lora_exclusions(tower: str | None, train_vision: bool) -> str | None:
    """peft's ``exclude_modules`` (a regex on module paths) that keeps LoRA off the vision tower ``tower``:
    ``lora.target_modules`` (``all-linear``, or names such as ``gate_proj`` that the tower's blocks share with the
    language model) then adapt the language model only; None with ``lora.train_vision`` or for a text-only base.

    >>> print(lora_exclusions("model.visual", False))
    model\\.visual\\..*
    """
    return None if tower is None or train_vision else re.escape(tower) + r"\..*"


def check_vision_tower(model, tower: str, train_vision: bool) -> None:
    """The vision tower as configured, checked on the built model (``ModelLoadError`` otherwise): not quantised
    (no bitsandbytes layer), and trained (LoRA only) exactly when ``lora.train_vision``."""
    module = inner_model(model).get_submodule(tower)
    quantized = [n for n, m in module.named_modules() if type(m).__module__.startswith("bitsandbytes")]
    if quantized:
        raise ModelLoadError(f"the vision tower {tower} was quantised ({quantized[0]}, ...): it must stay in the "
                             "compute dtype")
    trained = [n for n, p in module.named_parameters() if p.requires_grad]
    if trained and not train_vision:
        raise ModelLoadError(f"lora.train_vision is false, but the vision tower trains {trained[0]}")
    if train_vision and not any("lora_" in n for n in trained):
        raise ModelLoadError(f"lora.train_vision: lora.target_modules matched no linear layer of the vision tower "
                             f"{tower}; use all-linear or name its layers (qkv, proj, ...)")


def inner_model(model):
    """The transformers model: ``model`` itself, or the one a peft model wraps."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def keep_4bit_layout(model) -> None:
    """Turn off bitsandbytes' CPU inference repacking in ``model``'s 4-bit layers (training only): on a CPU with
    AVX512-BF16, a 4-bit layer in eval mode rewrites its weight's data in place into another layout and marks its
    quant state so. Evaluation during training then computes with other kernels than the training steps (the
    steps after it differ by ~1e-5), and under FSDP the rewrite lands on the gathered copy only: the next gather
    brings the old layout back under the new mark, and every output after the first evaluation is wrong."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def start_from_adapter(base, path: str, *, with_reference: bool):
    """``base`` + the LoRA adapter in ``path`` (``model.adapter_path``) as the trained ``default`` adapter; with
    ``with_reference`` (DPO), the same adapter once more beside it, frozen, as ``reference`` (what
    ``preference.reference_model`` computes with). Only ``default`` is saved with the run."""
    from peft import PeftModel

    from qlora_train.train.preference import REFERENCE_ADAPTER, TRAINED_ADAPTER
    from qlora_train.train.resume import refusing_unsafe_files

    try:
        with refusing_unsafe_files(path, "model.adapter_path"):
            model = PeftModel.from_pretrained(base, path, adapter_name=TRAINED_ADAPTER, is_trainable=True)
            if with_reference:
                model.load_adapter(path, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model.adapter_path: cannot load the adapter in {path}: {' '.join(str(exc).split())}") \
            from None
    model.set_adapter(TRAINED_ADAPTER)
    model.save_pretrained = functools.partial(model.save_pretrained, selected_adapters=[TRAINED_ADAPTER])
    return model


def check_head_trains_new_rows(model) -> None:
    """``ModelLoadError`` unless peft wrapped the output head too (tied to the embedding's trainable rows, or
    its own): otherwise the model could read the new tokens but never learn to write them."""
    from peft.utils import TrainableTokensWrapper

    head = model.get_output_embeddings()
    if head is not None and not isinstance(head, TrainableTokensWrapper):
        raise ModelLoadError(f"model.new_tokens: peft did not make the new rows of the output head "
                             f"({type(head).__name__}) trainable; the model could not learn to write the new tokens")


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
