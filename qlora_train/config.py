"""Typed configuration: one schema for the whole YAML, validated before anything heavy loads.

Each field's ``description`` is its help text; ``docs/config.md`` is generated from
these models (``python -m qlora_train.config``) and a test keeps the two in sync.
"""

from __future__ import annotations

import difflib
import glob as globlib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_REASONING_KEYS = ("reasoning", "reasoning_content", "thinking", "reason")
DEFAULT_TOOLS_COLUMNS = ("tools", "tool_schemas", "functions", "function_schemas")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


SCHEMAS = ("auto", "messages", "sharegpt", "prompt_response", "alpaca", "segments", "pretokenized", "text",
           "completion")
SchemaName = Literal["auto", "messages", "sharegpt", "prompt_response", "alpaca", "segments", "pretokenized",
                     "text", "completion"]
MaskRule = Literal["train", "mask"]
# DatasetSource keys that override the data-level value of the same name for that source's rows
FORMAT_OVERRIDES = ("dataset_schema", "messages_field", "message_property_mappings", "roles", "field_mappings",
                    "format", "no_input_format")


class RowHandlerSpec(_Section):
    """A registered row handler applied to a source's raw rows (``data.datasets[].handlers[]``)."""

    name: str = Field(
        description="Name given to `register_row_handler` (import its module via `data.handler_modules`)."
    )
    fn_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the handler.")
    batched: bool = Field(False, description="The handler takes a batch (dict of columns) instead of one row.")
    remove_columns: list[str] = Field(default_factory=list, description="Keys removed from each row afterwards.")


class DatasetSource(_Section):
    """One dataset entry under ``data.datasets`` (and ``data.eval_datasets``)."""

    path: str | list[str] = Field(
        description="A local JSON/JSONL/Parquet/CSV/Arrow file, a directory, a glob, or a hub dataset id; "
        "a list of them is concatenated."
    )
    name: str | None = Field(None, description="Dataset configuration name (hub datasets).")
    split: str = Field("train", description="Split to read.")
    builder: str | None = Field(
        None, description="datasets builder (json, parquet, csv, arrow) for files without a known extension."
    )
    data_files: str | list[str] | dict[str, str | list[str]] | None = Field(
        None, description="Files inside a hub dataset or directory to read (passed to `load_dataset`)."
    )
    weight: float | None = Field(
        None, gt=0, description="Mixing weight; with weights on every source, rows are interleaved by probability."
    )
    max_samples: int | None = Field(
        None, ge=1, validation_alias=AliasChoices("max_samples", "max_items"),
        description="Keep at most this many rows of this source (also accepted as `max_items`).",
    )
    handlers: list[RowHandlerSpec] = Field(
        default_factory=list, description="Registered row handlers applied, in order, to the raw rows."
    )
    dataset_schema: SchemaName | None = Field(
        None, validation_alias=AliasChoices("dataset_schema", "schema"),
        description="Row schema of this source (also accepted as `schema`); default: `data.dataset_schema`.",
    )
    messages_field: str | None = Field(None, description="Overrides `data.messages_field` for this source.")
    message_property_mappings: dict[str, str] | None = Field(
        None, description="Overrides `data.message_property_mappings` for this source."
    )
    roles: dict[str, list[str]] | None = Field(None, description="Overrides `data.roles` for this source.")
    field_mappings: dict[str, str] | None = Field(None, description="Overrides `data.field_mappings` for this source.")
    format: str | None = Field(None, description="Overrides `data.format` for this source.")
    no_input_format: str | None = Field(None, description="Overrides `data.no_input_format` for this source.")

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)


class MixingConfig(_Section):
    """How weighted sources are interleaved (``data.mixing``)."""

    seed: int = Field(42, description="Seed of the interleaving draw.")
    stopping_strategy: Literal["all_exhausted", "first_exhausted", "all_exhausted_without_replacement"] = Field(
        "all_exhausted",
        description="`all_exhausted` oversamples until every source is used up; `first_exhausted` stops at the "
        "first source used up; `all_exhausted_without_replacement` uses every row once (the mix drifts from the "
        "weights as sources run out).",
    )


class DataConfig(_Section):
    """Dataset settings (the ``data:`` section)."""

    datasets: list[DatasetSource] = Field(default_factory=list, description="Training data sources.")
    eval_datasets: list[DatasetSource] = Field(
        default_factory=list, description="Evaluation sources (instead of `eval_fraction`), concatenated."
    )
    mixing: MixingConfig = Field(default_factory=MixingConfig, description="Interleaving of weighted sources.")
    handler_modules: list[str] = Field(
        default_factory=list, description="Python modules imported first, so that their row handlers register."
    )
    dataset_schema: SchemaName = Field(
        "auto", validation_alias=AliasChoices("dataset_schema", "schema"),
        description="Row schema (also accepted as `schema`); `auto` detects it per row; `completion` = `text`.",
    )
    messages_field: str = Field("messages", description="Column holding the list of messages.")
    message_property_mappings: dict[str, str] = Field(
        default_factory=dict,
        description="Message key per canonical property, e.g. {role: from, content: value}.",
    )
    roles: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Canonical role <- role names in the data, e.g. {assistant: [gpt, bot], system: [knowledge]}.",
    )
    field_mappings: dict[str, str] = Field(
        default_factory=dict,
        description="Canonical row field <- column, e.g. {instruction: question, output: answer, text: body}.",
    )
    format: str | None = Field(
        None,
        description="alpaca: user turn text with `{instruction}` and `{input}` (default: both, a blank line apart).",
    )
    no_input_format: str | None = Field(
        None, description="alpaca: user turn text with `{instruction}` when the input is empty (default: `format`)."
    )
    assistant_roles: list[str] = Field(
        default_factory=lambda: ["assistant"], description="Roles whose turns are trained (when `mask` is unset)."
    )
    mask: dict[str, MaskRule] | None = Field(
        None, description="Per-role rule, e.g. {system: mask, user: mask, assistant: train}; replaces assistant_roles."
    )
    mask_default: MaskRule = Field("mask", description="Rule for roles that `mask` does not name.")
    train_on_eos: Literal["turn", "all", "last", "none"] = Field(
        "turn",
        description="End-of-turn markers trained: of trained turns (`turn`), after every message (`all`), "
        "of the last trained turn only (`last`), or none.",
    )
    last_turn_only: bool = Field(False, description="Train only the last trained turn of each conversation.")
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
    shuffle_seed: int = Field(42, description="Seed of the train/eval split and of `shuffle`.")
    shuffle: bool = Field(False, description="Shuffle the training rows once after mixing.")
    max_samples: int | None = Field(None, ge=1, description="Keep at most this many training rows after mixing.")
    dedup: bool = Field(False, description="Drop exact duplicates (same canonical messages), keeping the first.")
    min_chars: int = Field(0, ge=0, description="Drop rows with fewer characters of content (`filtered_by_length`).")
    max_chars: int | None = Field(None, ge=1, description="Drop rows with more characters of content.")
    domain_key: str | None = Field(None, description="Row field whose value names the row's domain in the report.")
    num_proc: int | None = Field(None, ge=1, description="Processes for the preprocessing map.")
    batch_size: int = Field(256, ge=1, description="Rows per preprocessing batch (one batched tokenizer call).")
    cache_dir: str | None = Field(None, description="datasets cache directory (default: the HF cache).")

    def for_source(self, src: DatasetSource) -> DataConfig:
        """The options that process ``src``'s rows: its format overrides (``FORMAT_OVERRIDES``) applied, and
        the source lists and mixing left out, so that one source's cache does not depend on the others."""
        update = {k: getattr(src, k) for k in FORMAT_OVERRIDES if getattr(src, k) is not None}
        return self.model_copy(update={**update, "datasets": [], "eval_datasets": [], "mixing": MixingConfig()})

    def trains_role(self, role: str) -> bool:
        """Whether messages of ``role`` are trained by the role rules (before per-message overrides)."""
        if self.mask is not None:
            return self.mask.get(role, self.mask_default) == "train"
        return role in self.assistant_roles

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.think_mode == "drop" and self.think_loss == "answer_plus_think":
            raise ValueError("think_mode: drop removes reasoning, so think_loss: answer_plus_think "
                             "has nothing to train")
        if not self.assistant_roles:
            raise ValueError("assistant_roles must name at least one role")
        if self.max_chars is not None and self.max_chars < self.min_chars:
            raise ValueError("max_chars must be at least min_chars")
        if self.eval_datasets and self.eval_fraction > 0:
            raise ValueError("set eval_fraction or eval_datasets, not both")
        weighted = [s.weight is not None for s in self.datasets]
        if any(weighted) and not all(weighted):
            raise ValueError("datasets: set `weight` on every source or on none")
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


def _resolve_relative(p: Any, base: Path) -> Any:
    """A dataset path relative to the YAML's directory, when it exists there (else as written)."""
    if not isinstance(p, str) or Path(p).is_absolute():
        return p
    if (base / p).exists() or any(ch in p for ch in "*?[") and globlib.glob(str(base / p)):
        return str(base / p)
    return p


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
    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    for source in (data.get("datasets") or []) + (data.get("eval_datasets") or []):
        if isinstance(source, dict) and isinstance(source.get("path"), (str, list)):
            paths = [_resolve_relative(p, path.parent) for p in (
                [source["path"]] if isinstance(source["path"], str) else source["path"])]
            source["path"] = paths[0] if isinstance(source["path"], str) else paths
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError([_describe(e) for e in exc.errors()], source=str(path)) from None


def config_reference_markdown() -> str:
    """Markdown reference of every section and key, generated from the schema."""
    lines = ["# Config reference", "", "Generated from `qlora_train/config.py` "
             "(`python -m qlora_train.config > docs/config.md`).", ""]
    sections = [("model", ModelConfig), ("lora", LoraSettings), ("data", DataConfig),
                ("data.mixing", MixingConfig), ("data.datasets[]", DatasetSource),
                ("data.datasets[].handlers[]", RowHandlerSpec), ("train", TrainConfig)]
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
