"""Typed configuration: one schema for the whole YAML, validated before anything heavy loads.

Each field's ``description`` is its help text; ``docs/config.md`` is generated from
these models (``python -m qlora_train.config``) and a test keeps the two in sync.
"""

from __future__ import annotations

import difflib
import glob as globlib
import os
import re
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qlora_train.chat_templates import ALIASES, shipped_templates, template_kwargs_problems
from qlora_train.errors import ConfigError
from qlora_train.locations import is_glob, looks_like_hub_id
from qlora_train.masking import DEFAULT_BUDGET, ReasoningHistory, ThinkLoss, TrainOnEos

DEFAULT_REASONING_KEYS = ("reasoning", "reasoning_content", "thinking", "reason")
DEFAULT_TOOLS_COLUMNS = ("tools", "tool_schemas", "functions", "function_schemas")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


SchemaName = Literal["auto", "messages", "sharegpt", "prompt_response", "alpaca", "segments", "pretokenized",
                     "text", "completion"]
SCHEMAS = get_args(SchemaName)
MaskRule = Literal["train", "mask"]
Objective = Literal["sft", "preference", "unpaired", "prompt"]  # data.objective: what a row is
RuleCheckMode = Literal["off", "sample", "all"]  # data.rule_check: rows also masked by the rule and compared
# train.method; dpo and orpo train on pairs, kto on unpaired rows, grpo on prompts (its completions sampled)
TrainMethod = Literal["sft", "dpo", "orpo", "kto", "grpo"]
# train.method -> the data.objective it trains on
METHOD_OBJECTIVE = {"sft": "sft", "dpo": "preference", "orpo": "preference", "kto": "unpaired", "grpo": "prompt"}
GrpoLoss = Literal["grpo", "dr_grpo", "dapo"]  # rl.loss_type
ScaleRewards = Literal["group", "batch", "none"]  # rl.scale_rewards
DpoLoss = Literal["sigmoid", "robust", "ipo"]  # train.dpo_loss
Distributed = Literal["ddp", "fsdp"]  # train.distributed
QuantStorage = Literal["auto", "uint8", "bfloat16", "float16", "float32"]  # model.bnb_4bit_quant_storage
# DatasetSource keys that override the data-level value of the same name for that source's rows
FORMAT_OVERRIDES = ("dataset_schema", "messages_field", "message_property_mappings", "roles", "field_mappings",
                    "format", "no_input_format", "image_dir")
ImageCheck = Literal["decode", "header"]  # data.image_check: how much of each image preprocessing reads
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000  # data.max_image_pixels: 8000x8000
DEFAULT_MAX_ROW_IMAGE_PIXELS = 256_000_000  # data.max_row_image_pixels: four images of the largest size


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
    builder: Literal["json", "parquet", "csv", "arrow"] | None = Field(
        None, description="datasets builder for files without a known extension."
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
    image_dir: str | None = Field(None, description="Overrides `data.image_dir` for this source.")

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)


def source_image_dir(src: DatasetSource) -> str | None:
    """The directory a source's relative image paths resolve against when ``image_dir`` is unset: a local file's
    directory, a local directory itself, a glob's leading directory (the part before its first wildcard); None (the
    current directory) for a hub dataset or paths that do not share one such directory."""
    dirs = set()
    for path in src.paths:
        p = Path(path).expanduser()
        if is_glob(path):
            fixed = []
            for part in p.parts:
                if is_glob(part):
                    break
                fixed.append(part)
            dirs.add(Path(*fixed) if fixed else Path("."))
        elif p.is_file():
            dirs.add(p.parent)
        elif p.is_dir():
            dirs.add(p)
        else:
            return None  # a hub dataset
    return str(dirs.pop()) if len(dirs) == 1 else None


class MixingConfig(_Section):
    """How weighted sources are interleaved (``data.mixing``)."""

    seed: int = Field(42, description="Seed of the interleaving draw.")
    stopping_strategy: Literal["all_exhausted", "first_exhausted", "all_exhausted_without_replacement"] = Field(
        "all_exhausted",
        description="`all_exhausted` oversamples until every source is used up; `first_exhausted` stops at the "
        "first source used up; `all_exhausted_without_replacement` uses every row once (the mix drifts from the "
        "weights as sources run out).",
    )


class RowBudgetConfig(_Section):
    """What one row may cost (``data.row_budget``): a row over any of these is refused (`over_budget`, the detail
    naming the budget and the amount) and counted; the run goes on. The defaults are far above what real long rows
    need (docs/masking.md#budgets)."""

    renders: int = Field(
        DEFAULT_BUDGET.renders, ge=1, description="Chat-template renders of one row: the general path and the "
        "rule check render 2 per trained turn, truncation and `reasoning_history: expand` a few more.",
    )
    row_chars: int = Field(
        DEFAULT_BUDGET.row_chars, ge=1, description="Characters those renders write together (the general path's "
        "cost grows with the square of a row's length).",
    )
    render_chars: int = Field(
        DEFAULT_BUDGET.render_chars, ge=1, description="Characters of one render, and of any string or list its "
        "template builds (measured before `*`, `**`, `%`, a width or a join builds it, after a `set`).",
    )
    steps: int = Field(
        DEFAULT_BUDGET.steps, ge=1, description="Loop iterations and macro calls of one render's template.",
    )
    seconds: float = Field(
        DEFAULT_BUDGET.seconds, gt=0, description="Wall-clock seconds of one row's rendering and masking (the only "
        "budget that depends on the machine: a backstop for a template that runs on).",
    )


class DataConfig(_Section):
    """Dataset settings (the ``data:`` section)."""

    datasets: list[DatasetSource] = Field(default_factory=list, description="Training data sources.")
    objective: Objective = Field(
        "sft", description="What a row is: `sft`, a conversation (or template-free row) to imitate; `preference`, "
        "a pair of responses to one prompt (`chosen`/`rejected` in any of the formats of docs/preference.md), "
        "each side rendered and masked as SFT would, both sides sharing the prompt; `unpaired`, a prompt, one "
        "completion and its `label` (KTO, docs/preference.md#kto-unpaired-rows), the completion trained; `prompt`, a "
        "prompt alone (a conversation ending with a user turn, or a `prompt` column) whose completions are sampled in "
        "training (GRPO, docs/rl.md), its other columns handed to the reward functions. Applies to every source; "
        "`train.method` sets it.",
    )
    min_score_margin: float | None = Field(
        None, description="With `objective: preference`: drop pairs whose `score_chosen - score_rejected` is below "
        "this (reason `below_score_margin`, also pairs without both scores).",
    )
    max_prompt_length: int | None = Field(
        None, ge=1, description="With `objective: preference`, `unpaired` or `prompt`: the prompt's limit in tokens: "
        "middle prompt exchanges dropped (for a pair, then its rendered reasoning trimmed) to fit; a prompt still over "
        "it is `too_long`. With `train.method: grpo` at most (and by default) `max_length - "
        "rl.max_completion_length`.",
    )
    max_response_length: int | None = Field(
        None, ge=1, description="With `objective: preference` or `unpaired`: each response's (completion's) limit in "
        "tokens (for a pair, after its reasoning is trimmed); a longer one is cut at the token level, losing its end "
        "(counted: `responses cut`), and so is one that would not otherwise fit `max_length`. Unset: such a row is "
        "`too_long`, never cut.",
    )
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
    train_on_eos: TrainOnEos = Field(
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
    think_loss: ThinkLoss = Field(
        "all",
        description="`all` trains the reasoning block with its tags; `answer_only` masks the whole block (the answer "
        "trained from its own first character); `answer_plus_think` trains reasoning text but masks the tags. What "
        "the generation prompt writes (an opener, a pre-filled empty block) is prompt under each.",
    )
    reasoning_history: ReasoningHistory = Field(
        "expand",
        description="Trained turns whose reasoning the chat template does not render (Qwen3 drops it before the "
        "last user query): `expand` adds one example per such turn (the conversation up to it, only it trained) "
        "so every turn's reasoning is trained once; `drop` trains them without it. Both count what is dropped.",
    )
    reasoning_history_max_examples: int = Field(
        16, ge=0, description="With `reasoning_history: expand`: at most this many extra examples per row; turns "
        "beyond it are trained without their reasoning (counted).",
    )
    tools_columns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TOOLS_COLUMNS),
        description="Columns searched, in order, for tool schemas (list, dict or JSON string).",
    )
    prompt_tools: list[str] = Field(
        default_factory=list, description="With `objective: prompt`: tools (`package.module:name`) every prompt is "
        "rendered with, their schemas given to the template as `tools`, so `max_prompt_length` counts them and a "
        "prompt the template refuses with them is dropped (`template_error`); a row with its own tools is refused "
        "(`tools_beside_rl_tools`). `train.method: grpo` sets it from `rl.tools` (docs/rl.md#tools).",
    )
    image_columns: list[str] = Field(
        default_factory=lambda: ["images", "image"], description="Row columns of images (a list, or one image), "
        "used in order by the `<image>` placeholders and the content parts `{type: image}` without a reference "
        "(docs/datasets.md#rows-with-images).",
    )
    image_placeholder: str = Field(
        "<image>", min_length=1, description="Text that marks where a row's next column image sits (LLaVA, "
        "ShareGPT, LLaMA-Factory); plain text in a row without an images column.",
    )
    image_dir: str | None = Field(
        None, description="Directory relative image paths resolve against. Unset: each source's own: a local data "
        "file's directory, a local directory source itself, a glob's leading directory; the current directory for "
        "a hub dataset or sources whose files lie in different directories.",
    )
    image_root: str | None = Field(
        None, description="Directory every image file must lie in (its links followed): an image path outside it "
        "refuses its row (`bad_image`). Unset: a row's image paths may name any file this user can read "
        "(docs/trust.md#images).",
    )
    max_image_pixels: int = Field(
        DEFAULT_MAX_IMAGE_PIXELS, ge=1, description="Images with more pixels (read from the header, before "
        "decoding; Pillow's own decompression-bomb guard is set to it) are refused with their row (`bad_image`).",
    )
    max_row_image_pixels: int = Field(
        DEFAULT_MAX_ROW_IMAGE_PIXELS, ge=1, description="Pixels one row's images may hold together, each reference "
        "counted (what its batch decodes for it; an image referred to again is read once here): a row over it is "
        "refused (`over_budget`) at the reference that passes it.",
    )
    image_check: ImageCheck = Field(
        "decode", description="`decode`: every image decoded once at preprocessing, so a corrupt file is refused "
        "with its row, not met in training; `header`: size and structure only (`Image.verify`), no pixels read "
        "(what `--stats-only` uses).",
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
    prepared_path: str | None = Field(
        None, description="A directory written by `--preprocess`: training and the diagnostics read the processed "
        "datasets from it instead of the raw files (which need not exist), refusing when its fingerprint does not "
        "match this data config, the tokenizer, its chat template, the pipeline code, the packing settings or the "
        "image files its rows refer to. Also where `--preprocess` writes when `--preprocess-dir` is not given.",
    )
    on_bad_row: Literal["skip", "error"] = Field(
        "skip", description="`skip`: drop a refused row, count it, warn once per reason with the first row's "
        "location; `error`: stop at the first refused row, naming it.",
    )
    on_too_long: Literal["truncate", "drop"] = Field(
        "truncate", description="Rows over `max_length`: `truncate` (structured, then token-level) or `drop` "
        "(reason `too_long`).",
    )
    row_budget: RowBudgetConfig = Field(
        default_factory=RowBudgetConfig, description="What one row may cost: renders, characters, template steps, "
        "seconds; a row over it is `over_budget`.",
    )
    rule_check: RuleCheckMode = Field(
        "sample", description="Rows whose mask the layout made (the fast path) also masked by the rule (per-turn "
        "prefix renders) and compared token by token: `sample`, the first 8 rows of each source (64 where "
        "`model.template_layout` declares a part) and 1 in 64 of the rest, by a hash of the row; `all`; `off`. A row "
        "where they differ is refused (`mask_disagrees`); more than 3 such rows, over 1% of those checked, stop the "
        "run (docs/masking.md#the-rule-checked-at-run-time).",
    )

    def for_source(self, src: DatasetSource) -> DataConfig:
        """The options that process ``src``'s rows: its format overrides (``FORMAT_OVERRIDES``) applied, and
        the source lists and mixing left out, so that one source's cache does not depend on the others. ``image_dir``
        is made absolute: set, or the source's own (``source_image_dir``); so is ``image_root``."""
        update = {k: getattr(src, k) for k in FORMAT_OVERRIDES if getattr(src, k) is not None}
        image_dir = update.get("image_dir", self.image_dir) or source_image_dir(src)
        update["image_dir"] = str(Path(image_dir).expanduser().absolute()) if image_dir else None
        if self.image_root:
            update["image_root"] = str(Path(self.image_root).expanduser().absolute())
        return self.model_copy(update={**update, "datasets": [], "eval_datasets": [], "mixing": MixingConfig()})

    # Section checks name their key first ("key: why"); _describe joins it to the section's path.
    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.think_mode == "drop" and self.think_loss == "answer_plus_think":
            raise ValueError("think_loss: answer_plus_think trains reasoning, but think_mode: drop removes it")
        if self.think_mode == "drop" and self.think_max_tokens:
            raise ValueError("think_max_tokens: caps reasoning, but think_mode: drop removes it (set 0)")
        if not self.assistant_roles:
            raise ValueError("assistant_roles: name at least one role")
        if self.max_chars is not None and self.max_chars < self.min_chars:
            raise ValueError("max_chars: must be at least min_chars")
        if self.eval_datasets and self.eval_fraction > 0:
            raise ValueError("eval_datasets: set eval_fraction or eval_datasets, not both")
        weighted = [s.weight is not None for s in self.datasets]
        if any(weighted) and not all(weighted):
            raise ValueError("datasets: set `weight` on every source or on none")
        if "objective" in self.model_fields_set:  # else train.method decides it (Config checks it then)
            self.check_objective_keys()
        return self

    def check_objective_keys(self) -> None:
        """Keys that apply to one objective only, checked once ``objective`` is decided."""
        if self.objective != "sft" and (self.dataset_schema != "auto" or any(
                s.dataset_schema not in (None, "auto") for s in self.datasets + self.eval_datasets)):
            raise ValueError(f"dataset_schema: names an SFT row schema, but with objective: {self.objective} every "
                             "row is read as a preference row (docs/preference.md formats): leave dataset_schema "
                             "unset")
        if self.min_score_margin is not None and self.objective != "preference":
            raise ValueError("min_score_margin: applies to preference pairs; set objective: preference (or unset "
                             "it)")
        if self.prompt_tools and self.objective != "prompt":
            raise ValueError("prompt_tools: applies to prompt rows (train.method: grpo sets it from rl.tools); unset "
                             "it")
        if self.max_prompt_length is not None and self.objective == "sft":
            raise ValueError("max_prompt_length: applies to preference pairs, unpaired rows and prompts; set "
                             "objective: preference, unpaired or prompt (or unset it)")
        if self.max_response_length is not None and self.objective in ("sft", "prompt"):
            raise ValueError("max_response_length: applies to preference pairs and unpaired rows (a sampled "
                             "completion's limit is rl.max_completion_length); set objective: preference or unpaired "
                             "(or unset it)")


class ModelConfig(_Section):
    """Base model settings (the ``model:`` section)."""

    name_or_path: str = Field(description="Hub id or local directory of the base model.")
    tokenizer: str | None = Field(None, description="Tokenizer path or id (default: name_or_path).")
    chat_template: str | None = Field(
        None, description="None: the tokenizer's own template (also `tokenizer`); or a shipped name (qwen3, "
        "qwen3.5, qwen2.5, chatml, llama3, gemma) or a .jinja path. A tokenizer without a template needs one named.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Template variables, e.g. {enable_thinking: false}, {reasoning_effort: "
        "low}: baked into the template as defaults, so every render and the saved tokenizer use them (a caller "
        "can still pass its own).",
    )
    template_layout: dict[str, Any] | None = Field(
        None, description="Parts of the chat template's layout declared instead of probed, e.g. {end_markers: "
        "['<|im_end|>']}: where a turn opens (assistant_header, turn_openers), reasoning (think_open, "
        "think_close), answer_open, end_markers, …. `--stats-only` and `--debug-samples` print the resolved "
        "layout in this form, to paste here and edit; every row is verified against it as against a probed one "
        "(docs/masking.md#seeing-and-declaring-the-layout). Baked into the template like chat_template_kwargs.",
    )
    adapter_path: str | None = Field(
        None, description="A LoRA adapter directory (an SFT run's output) that preference or RL training "
        "(`train.method: dpo | orpo | kto | grpo`) starts from: it is loaded as the trained adapter (its own LoRA "
        "settings, not the `lora:` section), and for DPO, KTO and GRPO with `rl.beta` once more, frozen, as the "
        "reference (docs/preference.md#training).",
    )
    load_in_4bit: bool = Field(True, description="Load the base in 4-bit nf4 with double quantisation.")
    load_in_8bit: bool = Field(False, description="Load the base in 8-bit instead.")
    compute_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Compute dtype of the quantised layers (float32 is used on CPU)."
    )
    bnb_4bit_quant_storage: QuantStorage = Field(
        "auto", description="dtype the packed 4-bit weights are stored in: `auto` is the compute dtype under "
        "`train.distributed: fsdp` (FSDP shards only float storage, and only when it equals the compute dtype) "
        "and uint8 otherwise. Anything else under FSDP stops the run before loading, naming the fix.",
    )
    attn_implementation: str | None = Field(None, description="eager / sdpa / flash_attention_2 (default: model's).")
    trust_remote_code: bool = Field(False, description="Allow code from the model repository to run.")
    new_tokens: list[str] | Literal["auto"] | None = Field(
        None, description="Texts added to the vocabulary as special tokens (never merged with the text around "
        "them), e.g. [\"<|im_start|>\", \"<|im_end|>\"]; or `auto`: the chat template's markers that are not "
        "single tokens of the vocabulary (a base model with a foreign template: ChatML on Llama 3). Training grows "
        "the embeddings when needed, starts each new row as the mean of the rows of the pieces the text was split "
        "into, and trains those rows only (embedding, and output head when untied), saved with the adapter; "
        "`--merge` and `--generate` resize the base to the saved tokenizer. Texts that are single tokens already "
        "are skipped. See docs/training.md#new-tokens-for-a-templates-markers.",
    )

    @field_validator("new_tokens", mode="before")
    @classmethod
    def _auto_or_a_list(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "auto":
            raise ValueError(f"use `auto` or a list of texts, e.g. [{value!r}]")
        return value

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_8bit: cannot be true together with load_in_4bit (pick one)")
        if isinstance(self.new_tokens, list):
            bad = [t for t in self.new_tokens if not t.strip()]
            if bad:
                raise ValueError(f"new_tokens: {bad[0]!r} is empty or only whitespace (a token must have text)")
            if len(set(self.new_tokens)) != len(self.new_tokens):
                twice = next(t for t in self.new_tokens if self.new_tokens.count(t) > 1)
                raise ValueError(f"new_tokens: {twice!r} is listed twice")
        if self.chat_template_kwargs:

            problems = template_kwargs_problems(self.chat_template_kwargs)
            if problems:
                raise ValueError(problems[0].removeprefix("model."))  # "chat_template_kwargs.<key>: why"
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
    train_vision: bool = Field(
        False, description="A vision-language model: LoRA on the vision tower's linear layers too (kept in the "
        "compute dtype, never quantised); false: the tower is frozen and LoRA adapts the language model only "
        "(docs/vision.md).")

    @model_validator(mode="after")
    def _check(self) -> LoraSettings:
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("target_modules: name at least one module, or use all-linear")
        return self


class TrainConfig(_Section):
    """Optimisation and output settings (the ``train:`` section)."""

    output_dir: str = Field("outputs/run", description="Where the adapter, tokenizer, config and reports go.")
    max_steps: int = Field(-1, description="Total optimiser steps (-1: use num_epochs).")
    num_epochs: float = Field(1.0, gt=0, description="Epochs when max_steps is -1.")
    per_device_train_batch_size: int = Field(1, ge=1, description="Examples per device per step.")
    per_device_eval_batch_size: int = Field(1, ge=1, description="Examples per device per eval step.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimiser step.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal[
        "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt",
        "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay",
    ] = Field("cosine", description="transformers scheduler name.")
    warmup_ratio: float = Field(0.03, ge=0.0, lt=1.0, description="Share of steps used for warm-up.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    optim: str = Field(
        "paged_adamw_8bit", description="transformers optimiser name; CUDA-only ones fall back to adamw_torch on CPU."
    )
    gradient_checkpointing: bool = Field(True, description="Recompute activations in backward to save memory.")
    fused_loss: bool = Field(
        True, description="Compute the LM head and the loss only at trained positions, in chunks of 1,024 tokens, "
        "instead of over full-vocabulary logits of every position (same loss, far less memory); models whose "
        "logits the head alone does not make fall back to their own loss, with a log line saying why.",
    )
    logging_steps: int = Field(10, ge=1, description="Log every N steps.")
    save_steps: int = Field(200, ge=1, description="Checkpoint every N steps.")
    save_total_limit: int | None = Field(3, ge=1, description="Keep at most N checkpoints.")
    eval_steps: int | None = Field(None, ge=1, description="Evaluate every N steps (default: save_steps).")
    seed: int = Field(42, description="Seed for model init, data order and dropout.")
    resume_from_checkpoint: str = Field(
        "auto", description="`auto`: a rerun resumes the newest checkpoint of the same config in `output_dir` and "
        "refuses a directory holding a finished run or another config's checkpoints (`--overwrite` starts over; "
        "docs/training.md#resume); a checkpoint path: resume from it as asked. `null` and `true` are `auto`.",
    )
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
    method: TrainMethod = Field(
        "sft", description="`sft`: supervised fine-tuning on chat rows; `dpo` (DPO / IPO, needs a reference: "
        "where training starts) or `orpo` (reference-free): preference training on pairs, each step one "
        "`[2 x batch, length]` batch of chosen and rejected rows (docs/preference.md#training); `kto` (KTO, "
        "Ethayarajh et al.; needs a reference): unpaired rows, each a completion labelled desirable or not, the KL "
        "term estimated from the batch's prompts paired with other rows' completions "
        "(docs/preference.md#kto-unpaired-rows); `grpo` (GRPO, Shao et al.): prompts, each step's completions "
        "sampled from the policy and scored by `rl.rewards`, the clipped surrogate of `rl.loss_type` (docs/rl.md).",
    )
    beta: float = Field(
        0.1, gt=0, description="dpo, kto: the temperature beta (how far the policy may move from the reference).",
    )
    dpo_loss: DpoLoss = Field(
        "sigmoid", description="dpo: `sigmoid` (DPO, Rafailov et al.; with `label_smoothing`, conservative DPO), "
        "`robust` (robust DPO, Chowdhury et al.: unbiased under `label_smoothing` flipped labels) or `ipo` (IPO, "
        "Azar et al.).",
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="dpo with `dpo_loss: sigmoid` or `robust`: the assumed share of flipped "
        "preference labels; 0 is plain DPO.",
    )
    orpo_lambda: float = Field(
        0.1, gt=0, description="orpo: weight of the odds-ratio term beside the NLL of the chosen response.",
    )
    desirable_weight: float = Field(
        1.0, gt=0, description="kto: weight of a desirable row's loss (TRL's `desirable_weight`); with "
        "undesirable_weight, balances unequal counts of the two labels (the KTO paper keeps desirable_weight x "
        "desirable rows / (undesirable_weight x undesirable rows) between 1 and 4/3).",
    )
    undesirable_weight: float = Field(1.0, gt=0, description="kto: weight of an undesirable row's loss.")
    distributed: Distributed = Field(
        "ddp", description="Several processes (`torchrun`, `accelerate launch`): `ddp`, each holds the whole "
        "model; `fsdp`, torch FSDP2 through accelerate, each holds 1/N of the 4-bit weights, for models larger "
        "than one GPU (docs/distributed.md). One process trains the same either way.",
    )
    fsdp_cpu_offload: bool = Field(
        False, description="With `distributed: fsdp`: keep the sharded parameters, gradients and optimizer state "
        "in CPU memory, moved to the GPU layer by layer (less GPU memory, slower steps; docs/distributed.md).",
    )

    @field_validator("output_dir", mode="before")
    @classmethod
    def _a_path(cls, value: Any) -> Any:
        if isinstance(value, str) and "$" in value:
            raise ValueError(f"{value!r} holds '$': environment variables are not expanded (a folder named "
                             "'$HOME' would be made); write the path itself (a leading ~ is expanded)")
        return os.path.expanduser(value) if isinstance(value, str) else value

    @field_validator("resume_from_checkpoint", mode="before")
    @classmethod
    def _auto_or_a_path(cls, value: Any) -> Any:
        if value is None or value is True:  # true: the latest checkpoint, as transformers reads it
            return "auto"
        if value is False:
            raise ValueError("false: a rerun does not start over silently (it resumes its own checkpoints or "
                             "refuses); use `auto` or a checkpoint path, and --overwrite to start over")
        return value

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError("max_steps: must be -1 (train num_epochs) or at least 1")
        if self.packing and self.group_by_length:
            raise ValueError("group_by_length: cannot be used with packing: true (packed sequences are already "
                             "of near-equal length)")
        if not self.packing and self.split_long:
            raise ValueError("split_long: needs packing: true")
        if not self.packing and self.packing_length is not None:
            raise ValueError("packing_length: needs packing: true")
        if self.method == "grpo" and (self.packing or self.group_by_length):
            key = "packing" if self.packing else "group_by_length"
            raise ValueError(f"{key}: not available with method: grpo (not supported yet: each prompt's sampled "
                             f"completions are batched as padded rows beside it); set {key}: false")
        if self.method != "sft" and self.packing:
            raise ValueError(f"packing: method: {self.method} trains each pair as two padded rows (chosen and "
                             "rejected) and cannot pack them; set packing: false")
        if self.method != "sft" and self.group_by_length:
            raise ValueError(f"group_by_length: not available with method: {self.method} (pairs are batched as "
                             "they come); set group_by_length: false")
        if self.method == "grpo" and self.distributed == "fsdp":
            raise ValueError("distributed: fsdp with method: grpo is not supported yet (sampling a sharded model "
                             "gathers every layer at each new token); train on one process")
        if self.fsdp_cpu_offload and self.distributed != "fsdp":
            raise ValueError("fsdp_cpu_offload: needs distributed: fsdp")
        if self.method == "kto" and self.per_device_train_batch_size < 2:
            raise ValueError("per_device_train_batch_size: method: kto estimates its KL term from each row's prompt "
                             "paired with another row's completion in the same batch; set at least 2")
        for key in ("desirable_weight", "undesirable_weight"):
            if key in self.model_fields_set and self.method != "kto":
                raise ValueError(f"{key}: applies to method: kto; remove it")
        if self.label_smoothing and (self.method != "dpo" or self.dpo_loss == "ipo"):
            raise ValueError("label_smoothing: applies to method: dpo with dpo_loss: sigmoid or robust only; "
                             "set it to 0")
        return self


REWARD_FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # rl.rewards[].function: package.module:name


class RewardSpec(_Section):
    """One reward function (``rl.rewards[]``)."""

    function: str = Field(
        description="`package.module:name` of a callable `f(prompts, completions, **columns) -> list[float | None]` "
        "(TRL's convention: a prompt's messages, each completion as `[{role: assistant, content: text}]`, the row's "
        "other columns by name, `completion_ids`); None leaves a completion out of this function's mean (counted). "
        "Built-ins: `qlora_train.rl.rewards:final_answer`, `:matches`, `:length_penalty` (docs/rl.md#rewards).",
    )
    weight: float = Field(1.0, description="Its weight in the summed reward.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments it is called with besides the row's columns, e.g. "
        "`{pattern: '^<think>'}` for `qlora_train.rl.rewards:matches`.",
    )

    @field_validator("function")
    @classmethod
    def _importable_name(cls, value: str) -> str:
        if not REWARD_FUNCTION.fullmatch(value):
            raise ValueError(f"{value!r}: expected 'package.module:name', e.g. 'qlora_train.rl.rewards:matches'")
        return value


class RLConfig(_Section):
    """Online RL (the ``rl:`` section): what ``train.method: grpo`` samples, how it scores and what it optimises
    (docs/rl.md). Each step samples ``num_generations`` completions for each of ``train.per_device_train_batch_size``
    prompts with the policy (the 4-bit base + the adapter being trained)."""

    rewards: list[RewardSpec] = Field(default_factory=list, description="The reward functions, summed by weight.")
    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (a group: advantages are "
                                 "each completion's reward against its group's).")
    max_completion_length: int = Field(
        256, ge=1, description="Tokens a completion may have; one that has not ended by then (no end-of-turn token) "
        "is truncated (counted; `mask_truncated`). The prompt gets `data.max_length` minus this.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the log-probs are of the same "
                               "tempered distribution, as TRL's).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens whose "
                         "probabilities reach top_p (1: all).")
    mask_truncated: bool = Field(
        False, description="Leave truncated completions (no end-of-turn token within max_completion_length) out "
        "of the loss (TRL's `mask_truncated_completions`); they still count in the rewards and advantages.",
    )
    scale_rewards: ScaleRewards = Field(
        "group", description="Advantage = reward minus its group's mean, divided by the group's std (`group`), "
        "the micro-batch's std (`batch`) or nothing (`none`, Dr. GRPO).",
    )
    loss_type: GrpoLoss = Field(
        "dapo", description="The clipped surrogate's reduction (TRL's): `grpo`, each completion's mean over its "
        "tokens, then the mean over completions; `dr_grpo`, the sum over tokens / (completions x "
        "max_completion_length); `dapo`, the sum over the tokens of the optimizer step's completions / their count.",
    )
    epsilon: float = Field(0.2, gt=0, description="Clipping: the ratio pi/pi_old is kept within [1 - epsilon, "
                           "1 + epsilon_high].")
    epsilon_high: float | None = Field(None, gt=0, description="The upper clip (default: epsilon; DAPO uses 0.28).")
    beta: float = Field(
        0.0, ge=0, description="Weight of the KL term to the reference (the base with the adapter off, or the "
        "frozen `model.adapter_path`: as DPO's); 0 skips the reference pass.",
    )
    num_iterations: int = Field(
        1, ge=1, description="Optimizer steps on each step's completions (mu in the GRPO paper): the old policy's "
        "log-probs are kept from when they were sampled, so the ratio and its clip act from the second step.",
    )
    tools: list[str] = Field(
        default_factory=list, description="Tools the model may call, each `package.module:name` of a Python "
        "function with type hints and a Google-style docstring (its JSON schema, transformers' `get_json_schema`, is "
        "given to the chat template as `tools`): each rollout becomes a multi-turn agent rollout (docs/rl.md#tools). "
        "Built-in: `qlora_train.rl.calculator:calculate`.",
    )
    max_turns: int = Field(4, ge=1, description="With `tools`: completions per rollout; one still calling at the "
                           "last ends there (counted).")
    tool_timeout_s: float = Field(10.0, gt=0, description="With `tools`: seconds a call may run; past it the model "
                                  "reads an error (counted).")
    tool_max_chars: int = Field(2000, ge=1, description="With `tools`: characters of a call's output the model reads "
                                "(the rest cut, said so).")
    tool_call_format: dict[str, Any] | None = Field(
        None, description="With `tools`: how the template writes a call, where the probe cannot read it: {kind: "
        "json | name_json | name_xml, prefix, suffix, middle, name_key, arguments_key, key_open, key_close, "
        "value_close} (qlora_train.rl.tool_calls.CallFormat), checked against the template's own render.",
    )
    guided_first_call: bool = Field(
        False, description="With `tools`: the first completion of each rollout drawn restricted to the shape of a "
        "call to the first tool (its fixed text forced, the argument's value drawn by the model from digits, "
        "operators and spaces): a demo device for a model that cannot write a call yet (the random tiny model; make "
        "demo-agent's own model writes its calls); those draws are off-policy (docs/rl.md#the-agent-demo).",
    )
    malformed_call_reward: float | None = Field(
        None, description="With `tools`: the reward of a rollout whose call does not parse (it ends there, counted); "
        "unset: its rewards as the reward functions compute them.",
    )

    @field_validator("tools")
    @classmethod
    def _importable_tools(cls, value: list[str]) -> list[str]:
        for i, name in enumerate(value):
            if not REWARD_FUNCTION.fullmatch(name):
                raise ValueError(f"[{i}] {name!r}: expected 'package.module:name', e.g. "
                                 "'qlora_train.rl.calculator:calculate'")
        return value


class Config(_Section):
    """The whole YAML file."""

    model: ModelConfig
    lora: LoraSettings = Field(default_factory=LoraSettings)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rl: RLConfig = Field(default_factory=RLConfig)

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.model.adapter_path and self.train.method == "sft":
            raise ValueError("model.adapter_path: starts preference or RL training (train.method: dpo, orpo, kto or "
                             "grpo); "
                             "an SFT run starts a fresh adapter, remove the key")
        if self.train.distributed == "fsdp" and self.model.load_in_8bit:
            raise ValueError("model.load_in_8bit: FSDP cannot shard 8-bit weights; use load_in_4bit: true "
                             "(or train.distributed: ddp)")
        wanted = METHOD_OBJECTIVE[self.train.method]
        if wanted != "sft" and self.data.objective != wanted:
            if "objective" in self.data.model_fields_set:
                what = {"preference": "preference pairs", "unpaired": "unpaired rows (prompt, completion, label)",
                        "prompt": "prompts (its completions are sampled)"}[wanted]
                raise ValueError(f"data.objective: train.method: {self.train.method} trains on {what}; set "
                                 f"data.objective: {wanted} (or leave it out)")
            self.data.objective = wanted  # train.method decides what a row is
        try:
            self.data.check_objective_keys()
        except ValueError as err:
            raise ValueError(f"data.{err}") from None
        if self.train.method == "grpo":
            self._check_grpo()
        elif "rl" in self.model_fields_set:
            raise ValueError(f"rl: the rl section configures train.method: grpo (the method is "
                             f"{self.train.method}); remove it")
        if self.data.objective != "sft" and (self.train.packing or self.train.group_by_length):
            key = "packing" if self.train.packing else "group_by_length"
            how = {"preference": "preference pairs are batched as two whole padded rows each (chosen and rejected "
                                 "sharing a prompt)",
                   "unpaired": "unpaired rows are batched as whole padded rows (each beside the rows its KL term "
                               "borrows a completion from)",
                   "prompt": "prompts are batched with their sampled completions as padded rows"}[self.data.objective]
            raise ValueError(f"train.{key}: {how}: set train.{key}: false for data.objective: {self.data.objective}")
        return self

    def _check_grpo(self) -> None:
        """``train.method: grpo``: at least one reward, and room for the prompt beside the completion: the prompt's
        limit (``data.max_prompt_length``) is ``data.max_length - rl.max_completion_length``, or less when set."""
        if not self.rl.rewards:
            raise ValueError("rl.rewards: train.method: grpo needs at least one reward function, e.g. "
                             "[{function: 'qlora_train.rl.rewards:matches', kwargs: {pattern: 'yes'}}]")
        room = self.data.max_length - self.rl.max_completion_length
        if room < 1:
            raise ValueError(f"rl.max_completion_length: {self.rl.max_completion_length} leaves no room for the prompt "
                             f"within data.max_length {self.data.max_length}: lower it or raise data.max_length")
        if self.rl.tools and not self.data.prompt_tools:
            self.data.prompt_tools = list(self.rl.tools)  # the prompts rendered with the rollouts' tools, once
        elif self.data.prompt_tools != self.rl.tools:
            raise ValueError(f"data.prompt_tools: {self.data.prompt_tools} differs from rl.tools {self.rl.tools}: "
                             "the prompts must be rendered with the tools the rollouts run; leave it out")
        if self.data.max_prompt_length is None:
            self.data.max_prompt_length = room  # the prompt's limit, decided here once
        elif self.data.max_prompt_length > room:
            raise ValueError(f"data.max_prompt_length: {self.data.max_prompt_length} + rl.max_completion_length "
                             f"{self.rl.max_completion_length} > data.max_length {self.data.max_length}: a prompt "
                             f"and its completion must fit max_length; set at most {room} (or leave it out)")

    @property
    def packing_length(self) -> int:
        """Tokens per packed sequence: ``train.packing_length``, else ``data.max_length``."""
        return self.train.packing_length or self.data.max_length


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


def key_path(loc: tuple) -> str:
    """``("data", "datasets", 0, "path")`` -> ``"data.datasets[0].path"``."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "<root>"


def _describe(err: dict) -> str:
    loc = tuple(err["loc"])
    path = key_path(loc)
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), _known_keys(Config, loc), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"{path}: unknown key{hint}"
    msg = err["msg"].removeprefix("Value error, ")
    key, sep, why = msg.partition(": ")
    if err["type"] == "value_error" and sep and key.split(".")[0] in _known_keys(Config, loc + (key,)):
        return f"{path}.{key}: {why}" if loc else f"{key}: {why}"  # a section (or whole-config) check naming its key
    return f"{path}: {msg}"


def _local_dir_problem(key: str, value: Any) -> list[str]:
    if not isinstance(value, str) or looks_like_hub_id(value) or Path(value).expanduser().is_dir():
        return []
    return [f"{key}: local directory not found: {value} (a hub id looks like 'org/name')"]


def _dataset_problems(data: dict) -> list[str]:
    sources = data.get("datasets")
    if not sources:
        return ["data.datasets: name at least one data source"]
    if data.get("prepared_path"):  # the raw files are read by --preprocess only, which checks them itself
        return []
    problems = []
    for key, src in _sources(data):
        paths = src.get("path")
        listed = isinstance(paths, list)
        for j, path in enumerate(paths if listed else [paths]):
            if not isinstance(path, str):
                continue
            where = f"{key}.path" + (f"[{j}]" if listed else "")
            if is_glob(path):
                if not globlib.glob(path, recursive=True):
                    problems.append(f"{where}: no file matches the glob {path}")
            elif not Path(path).exists() and not looks_like_hub_id(path):
                problems.append(f"{where}: file not found: {path}")
    return problems


def _chat_template_problem(value: Any) -> list[str]:
    names = shipped_templates()
    if not isinstance(value, str) or value == "tokenizer" or ALIASES.get(value, value) in names:
        return []
    if value.endswith(".jinja"):
        return [] if Path(value).is_file() else [f"model.chat_template: template file not found: {value}"]
    close = difflib.get_close_matches(value, names + list(ALIASES), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return [f"model.chat_template: unknown template '{value}'{hint}: use one of {names} or a .jinja path, "
            "or leave it unset for the tokenizer's own"]


def file_problems(tree: dict) -> list[str]:
    """Paths the config names that cannot be used, checked on the raw YAML tree (so every problem is listed).

    Data files, local model/tokenizer directories, a ``.jinja`` template, a resume
    checkpoint, and an ``output_dir`` that is a file. Hub ids are not looked up.
    """
    section = lambda name: tree.get(name) if isinstance(tree.get(name), dict) else {}
    model, data, train = section("model"), section("data"), section("train")
    problems = _dataset_problems(data)
    problems += _local_dir_problem("model.name_or_path", model.get("name_or_path"))
    problems += _local_dir_problem("model.tokenizer", model.get("tokenizer"))
    problems += _local_dir_problem("model.adapter_path", model.get("adapter_path"))
    problems += _chat_template_problem(model.get("chat_template"))
    resume = train.get("resume_from_checkpoint")
    if isinstance(resume, str) and resume != "auto" and not Path(resume).is_dir():
        problems.append(f"train.resume_from_checkpoint: checkpoint directory not found: {resume} "
                        "(or use 'auto')")
    out = train.get("output_dir")
    if isinstance(out, str) and Path(out).expanduser().is_file():
        problems.append(f"train.output_dir: is a file, not a directory: {out}")
    return problems


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError([f"{dotted}: cannot set a key under a non-mapping value"])
    node[keys[-1]] = value


def _resolve_relative(p: Any, base: Path, *, absent_to_base: bool = False) -> Any:
    """A dataset path relative to the YAML's directory, when it exists there (else as written).

    ``absent_to_base`` (``data.prepared_path`` set, the raw files perhaps on another machine): a local path found
    neither there nor here is also taken as relative to the YAML's directory, as it most likely was where the data
    was prepared, so that the sources compare equal in the prepared data's fingerprint."""
    if not isinstance(p, str) or Path(p).is_absolute():
        return p
    if (base / p).exists() or is_glob(p) and globlib.glob(str(base / p)):
        return str(base / p)
    found_here = globlib.glob(p) if is_glob(p) else Path(p).exists()
    if absent_to_base and not found_here and not looks_like_hub_id(p):
        return str(base / p)
    return p


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """YAML file (+ ``key.path=value`` overrides, applied last) -> validated ``Config``.

    Relative dataset and ``.jinja`` paths are resolved against the YAML file's
    directory when they exist there. Checks the schema and the paths the config
    names (``file_problems``) and raises ``ConfigError`` listing every problem.
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
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ConfigError([f"--set {key.strip()}: value {raw!r} is not valid YAML"]) from None
        _set_path(tree, key.strip(), value)
    _resolve_relative_paths(tree, path.parent)
    problems = file_problems(tree)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as exc:
        problems = [_describe(e) for e in exc.errors()] + problems
    if problems:
        raise ConfigError(problems, source=str(path))
    return cfg


def _sources(data: dict) -> list[tuple[str, dict]]:
    """``(key path, source)`` of every entry of ``data.datasets`` and ``data.eval_datasets`` in the raw tree."""
    out = []
    for section in ("datasets", "eval_datasets"):
        entries = data.get(section)
        for i, src in enumerate(entries if isinstance(entries, list) else []):
            if isinstance(src, dict):
                out.append((f"data.{section}[{i}]", src))
    return out


def _resolve_relative_paths(tree: dict, base: Path) -> None:
    """Relative dataset and ``.jinja`` paths that exist next to the YAML file are made relative to it."""
    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    absent_to_base = bool(data.get("prepared_path"))
    for _, source in _sources(data):
        if isinstance(source.get("path"), str):
            source["path"] = _resolve_relative(source["path"], base, absent_to_base=absent_to_base)
        elif isinstance(source.get("path"), list):
            source["path"] = [_resolve_relative(p, base, absent_to_base=absent_to_base) for p in source["path"]]
    model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    if isinstance(model.get("chat_template"), str) and model["chat_template"].endswith(".jinja"):
        model["chat_template"] = _resolve_relative(model["chat_template"], base)


def config_reference_markdown() -> str:
    """Markdown reference of every section and key, generated from the schema."""
    lines = ["# Config reference", "", "Generated from `qlora_train/config.py` "
             "(`python -m qlora_train.config > docs/config.md`).", ""]
    sections = [("model", ModelConfig), ("lora", LoraSettings), ("data", DataConfig),
                ("data.mixing", MixingConfig), ("data.row_budget", RowBudgetConfig), ("data.datasets[]", DatasetSource),
                ("data.datasets[].handlers[]", RowHandlerSpec), ("train", TrainConfig), ("rl", RLConfig),
                ("rl.rewards[]", RewardSpec)]
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
