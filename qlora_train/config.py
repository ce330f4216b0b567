"""Typed configuration: one schema for the whole YAML, validated before anything heavy loads.

Each field's ``description`` is its help text; ``docs/config.md`` is generated from
these models (``python -m qlora_train.config``) and a test keeps the two in sync.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_REASONING_KEYS = ("reasoning", "reasoning_content", "thinking", "reason")
DEFAULT_TOOLS_COLUMNS = ("tools", "tool_schemas", "functions", "function_schemas")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DatasetSource(_Section):
    """One dataset entry under ``data.datasets``."""

    path: str = Field(description="A local JSON/JSONL/Parquet/CSV/Arrow file, a directory, or a glob.")
    split: str = Field("train", description="Split to read.")
    builder: str | None = Field(
        None, description="datasets builder (json, parquet, csv, arrow) for files without a known extension."
    )
    max_samples: int | None = Field(None, ge=1, description="Keep at most this many rows of this source.")


class DataConfig(_Section):
    """Dataset settings (the ``data:`` section)."""

    datasets: list[DatasetSource] = Field(default_factory=list, description="Training data sources.")
    dataset_schema: Literal["auto", "messages", "sharegpt", "prompt_response"] = Field(
        "auto", description="Row schema; `auto` detects it per row."
    )
    messages_field: str = Field("messages", description="Column holding the list of messages.")
    assistant_roles: list[str] = Field(
        default_factory=lambda: ["assistant"], description="Roles whose turns are trained."
    )
    max_length: int = Field(2048, ge=1, description="Maximum tokens per example after truncation.")
    truncate_side: Literal["left", "right"] = Field(
        "left", description="Side cut by the token-level fallback when structured truncation is not enough."
    )
    extract_think_tags: bool = Field(
        True, description="Move inline <think>…</think> in assistant content into `reasoning_content`."
    )
    reasoning_keys: list[str] = Field(
        default_factory=lambda: list(DEFAULT_REASONING_KEYS),
        description="Message keys whose value is moved into `reasoning_content` (first non-empty wins).",
    )
    think_mode: Literal["keep", "drop"] = Field("keep", description="`drop` removes all reasoning.")
    think_max_tokens: int = Field(0, ge=0, description="Cap reasoning at this many tokens (0 = no cap).")
    think_loss: Literal["all", "answer_only", "answer_plus_think"] = Field(
        "all",
        description="`all` trains the reasoning block with its tags; `answer_only` masks the whole block; "
        "`answer_plus_think` trains reasoning text but masks the tags.",
    )
    tools_columns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TOOLS_COLUMNS),
        description="Columns searched, in order, for tool schemas (list, dict or JSON string).",
    )
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="Share of rows held out for evaluation.")
    shuffle_seed: int = Field(42, description="Seed of the train/eval split.")
    num_proc: int | None = Field(None, ge=1, description="Processes for the preprocessing map.")
    batch_size: int = Field(256, ge=1, description="Rows per preprocessing batch (one batched tokenizer call).")
    cache_dir: str | None = Field(None, description="datasets cache directory (default: the HF cache).")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.think_mode == "drop" and self.think_loss == "answer_plus_think":
            raise ValueError("think_mode: drop removes reasoning, so think_loss: answer_plus_think "
                             "has nothing to train")
        if not self.assistant_roles:
            raise ValueError("assistant_roles must name at least one role")
        return self


class ModelConfig(_Section):
    """Base model settings (the ``model:`` section)."""

    name_or_path: str = Field(description="Hub id or local directory of the base model.")
    tokenizer: str | None = Field(None, description="Tokenizer path or id (default: name_or_path).")
    chat_template: str = Field(
        "qwen3", description="Shipped template name, `tokenizer` (keep the tokenizer's own), or a .jinja path."
    )
    load_in_4bit: bool = Field(True, description="Load the base in 4-bit nf4 with double quantisation.")
    load_in_8bit: bool = Field(False, description="Load the base in 8-bit instead.")
    compute_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Compute dtype of the quantised layers (float32 is used on CPU)."
    )
    attn_implementation: str | None = Field(None, description="eager / sdpa / flash_attention_2 (default: model's).")
    trust_remote_code: bool = Field(False, description="Allow code from the model repository to run.")

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit cannot both be true")
        return self


class LoraSettings(_Section):
    """LoRA adapter settings (the ``lora:`` section)."""

    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA alpha (scaling = alpha / r).")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Modules to adapt; `all-linear` adapts every linear layer but the output head."
    )
    modules_to_save: list[str] | None = Field(None, description="Modules trained in full and saved with the adapter.")


class TrainConfig(_Section):
    """Optimisation and output settings (the ``train:`` section)."""

    output_dir: str = Field("outputs/run", description="Where the adapter, tokenizer, config and reports go.")
    max_steps: int = Field(-1, description="Total optimiser steps (-1: use num_epochs).")
    num_epochs: float = Field(1.0, gt=0, description="Epochs when max_steps is -1.")
    per_device_train_batch_size: int = Field(1, ge=1, description="Examples per device per step.")
    per_device_eval_batch_size: int = Field(1, ge=1, description="Examples per device per eval step.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimiser step.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: str = Field("cosine", description="transformers scheduler name (cosine, linear, constant, …).")
    warmup_ratio: float = Field(0.03, ge=0.0, lt=1.0, description="Share of steps used for warm-up.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    optim: str = Field(
        "paged_adamw_8bit", description="transformers optimiser name; CUDA-only ones fall back to adamw_torch on CPU."
    )
    gradient_checkpointing: bool = Field(True, description="Recompute activations in backward to save memory.")
    logging_steps: int = Field(10, ge=1, description="Log every N steps.")
    save_steps: int = Field(200, ge=1, description="Checkpoint every N steps.")
    save_total_limit: int | None = Field(3, ge=1, description="Keep at most N checkpoints.")
    eval_steps: int | None = Field(None, ge=1, description="Evaluate every N steps (default: save_steps).")
    seed: int = Field(42, description="Seed for model init, data order and dropout.")
    resume_from_checkpoint: str | None = Field(None, description="A checkpoint path, or `auto` for the latest one.")
    report_to: list[str] | str = Field("tensorboard", description="Loggers: tensorboard, wandb, none, …")
    dataloader_num_workers: int = Field(0, ge=0, description="DataLoader worker processes.")
    packing: bool = Field(
        False, description="Pack whole examples (best-fit-decreasing) into sequences of `packing_length` tokens; "
        "attention never crosses examples. Each packed sequence counts as one example of a batch.",
    )
    packing_length: int | None = Field(
        None, ge=1, description="Tokens per packed sequence (default: data.max_length)."
    )
    split_long: bool = Field(
        False, description="With packing: cut examples longer than `packing_length` into pieces "
        "instead of refusing to start.",
    )
    group_by_length: bool = Field(
        False, description="Without packing: batch examples of similar length together (less padding)."
    )

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.packing and self.group_by_length:
            raise ValueError("packing and group_by_length cannot both be true (packed sequences are already "
                             "of near-equal length)")
        if not self.packing and (self.split_long or self.packing_length is not None):
            raise ValueError("split_long and packing_length need packing: true")
        return self


class Config(_Section):
    """The whole YAML file."""

    model: ModelConfig
    lora: LoraSettings = Field(default_factory=LoraSettings)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)


class ConfigError(Exception):
    """Every problem of a config, one line each, naming the key path."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        ann = field.annotation
        inner = getattr(ann, "__args__", (ann,))
        sub = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is None:
            return []
        model = sub
    return list(model.model_fields)


def _describe(err: dict) -> str:
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc) or "<root>"
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), _known_keys(Config, loc), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"{path}: unknown key{hint}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{path}: {msg}"


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError([f"{dotted}: cannot set a key under a non-mapping value"])
    node[keys[-1]] = value


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """YAML file (+ ``key.path=value`` overrides, applied last) -> validated ``Config``.

    Relative dataset paths are resolved against the YAML file's directory when
    they exist there. Raises ``ConfigError`` listing every problem.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"config file not found: {path}"])
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: invalid YAML: {exc}"]) from None
    if not isinstance(tree, dict):
        raise ConfigError([f"{path}: the top level must be a mapping"])
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError([f"--set {item!r}: expected key.path=value"])
        key, raw = item.split("=", 1)
        _set_path(tree, key.strip(), yaml.safe_load(raw))
    for source in (tree.get("data") or {}).get("datasets") or []:
        if isinstance(source, dict) and isinstance(source.get("path"), str):
            candidate = path.parent / source["path"]
            if not Path(source["path"]).is_absolute() and candidate.exists():
                source["path"] = str(candidate)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError([_describe(e) for e in exc.errors()], source=str(path)) from None


def config_reference_markdown() -> str:
    """Markdown reference of every section and key, generated from the schema."""
    lines = ["# Config reference", "", "Generated from `qlora_train/config.py` "
             "(`python -m qlora_train.config > docs/config.md`).", ""]
    sections = [("model", ModelConfig), ("lora", LoraSettings), ("data", DataConfig),
                ("data.datasets[]", DatasetSource), ("train", TrainConfig)]
    for name, model in sections:
        lines += [f"## `{name}`", "", model.__doc__.strip(), "", "| key | type | default | meaning |",
                  "| --- | --- | --- | --- |"]
        for key, field in model.model_fields.items():
            default = "required" if field.is_required() else repr(
                field.default_factory() if field.default_factory else field.default)
            ann = re.sub(r"[\w.]+\.(\w+)", r"\1", str(field.annotation)).replace("|", "\\|")
            lines.append(f"| `{key}` | `{ann}` | `{default}` | {field.description or ''} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(config_reference_markdown())
