"""The diagnostics flow: tokenizer + the training data pipeline, no model weights.

``--stats-only`` prints the length report and writes ``stats.json`` and
``token_lengths.png``; ``--debug-samples N`` prints N processed samples and
writes ``debug_samples.html``. ``--stats-only`` checks images by their header alone (``data.image_check:
header``: no pixel decoded) unless it reads prepared rows. Both first print the chat template's resolved
layout as YAML that pastes into ``model.template_layout`` and write it to
``template_layout.yaml``. Both write into ``out_dir`` (``--stats-dir``,
default ``train.output_dir``). With ``data.prepared_path`` set they read the rows ``--preprocess`` saved there.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from qlora_train.config import Config, DataConfig
from qlora_train.data.pipeline import objective
from qlora_train.data.prepared import diagnostic_rows
from qlora_train.diagnostics.html import debug_html
from qlora_train.diagnostics.samples import format_sample, legend, load_samples, select_indices
from qlora_train.diagnostics.stats import (
    compute_stats,
    marker_stats,
    stats_lines,
    tool_schema_tokens,
    write_histogram,
)
from qlora_train.files import write_atomic
from qlora_train.masking import layout_yaml, resolve_layout
from qlora_train.output_dir import claim_output_dir, run_inputs
from qlora_train.terminal import visible
from qlora_train.tokenizer import NO_NEW_TOKENS, NewTokens

log = logging.getLogger(__name__)
STATS_FILE, HISTOGRAM_FILE, HTML_FILE = "stats.json", "token_lengths.png", "debug_samples.html"
LAYOUT_FILE = "template_layout.yaml"


@dataclass(frozen=True)
class DebugOptions:
    samples: int = 0  # 0: no samples
    seed: int | None = None  # None: the first rows
    tokens: bool = False  # one line per token
    refused: bool = False  # show refused rows (with their reason) instead of kept ones


def use_color(stream: TextIO) -> bool:
    """Colour only on a terminal and when ``NO_COLOR`` is unset or empty."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def tool_tokens_per_row(raw, cols: dict[str, list], tokenizer, cfg: Config) -> dict[int, int]:
    """Row index -> tokens its tool schemas take in its render: the pipeline's ``tool_schema_tokens`` column
    (the template's tool block located in the one render). Only rows whose block was not found where the
    probe put it (-1) are measured again, by rendering them without their tools."""
    counts = cols.get("tool_schema_tokens", ())
    found = {i: n for i, n in enumerate(counts) if n > 0}
    missing = [i for i, n in enumerate(counts) if n < 0]
    if missing:
        rows = {i: json.loads(text) for i, text in zip(missing, raw.select(missing)["row"])}
        found.update(tool_schema_tokens(rows, tokenizer, cfg.data))
    return found


def layout_report(tokenizer, *, out_dir: Path, stream: TextIO) -> str:
    """Print the template's resolved layout (probed, and declared in ``model.template_layout``) as the YAML
    that declares it; write it to ``template_layout.yaml``. Returns the YAML."""
    text = layout_yaml(resolve_layout(tokenizer))
    write_atomic(out_dir / LAYOUT_FILE, text)
    print("== template layout", file=stream)
    print(visible(text + f"wrote {out_dir / LAYOUT_FILE}"), file=stream)  # a template's markers are its own
    return text


def stats_report(raw, processed, tokenizer, cfg: Config, *, out_dir: Path, stream: TextIO,
                 new_tokens: NewTokens = NO_NEW_TOKENS) -> dict:
    """Print the report; write ``stats.json`` and the histogram. Returns the stats."""
    cols = processed.select_columns(list(objective(cfg.data).row_type.stats_columns)).to_dict()
    tools = tool_tokens_per_row(raw, cols, tokenizer, cfg)
    markers = marker_stats(tokenizer, new_tokens, cfg.model.new_tokens)
    stats = compute_stats(cols, max_length=cfg.data.max_length, tool_tokens=tools, data=cfg.data, markers=markers)
    text = json.dumps(stats, indent=2, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a row (a role name): written as its JSON escape
        text = json.dumps(stats, indent=2)
    write_atomic(out_dir / STATS_FILE, text)
    write_histogram(cols, max_length=cfg.data.max_length, path=out_dir / HISTOGRAM_FILE,
                    pairs="chosen_tokens" in cols)
    print(visible("\n".join(stats_lines(stats))), file=stream)  # role names, refusal details: row text
    print(f"wrote {out_dir / STATS_FILE} and {out_dir / HISTOGRAM_FILE}", file=stream)
    return stats


def debug_report(raw, processed, tokenizer, opts: DebugOptions, *, out_dir: Path, stream: TextIO,
                 data: DataConfig | None = None, rollout: Callable[[dict], str] | None = None) -> list:
    """Print ``opts.samples`` samples; write ``debug_samples.html``. Returns the samples. With ``data`` (the run's
    data config), a row refused as ``mask_disagrees`` is shown with both its masks. With ``rollout`` (an agent
    config: ``agent_rollouts``), each kept prompt row is followed by what it returns for the row's processed
    columns."""
    indices = select_indices(processed["drop_reason"], opts.samples, seed=opts.seed, refused=opts.refused)
    samples = load_samples(raw, processed, tokenizer, indices, data)
    color = use_color(stream)
    what = "refused" if opts.refused else "kept"
    print(f"{len(samples)} {what} samples ({'seed ' + str(opts.seed) if opts.seed is not None else 'first rows'}); "
          + legend(color=color), file=stream)
    for sample in samples:
        print(format_sample(sample, color=color, show_tokens=opts.tokens), file=stream)
        if rollout is not None and sample.generation_prompt:
            print(visible(rollout(processed[sample.index])), file=stream)
    if not samples:
        print(f"no {what} rows to show" + ("" if opts.refused else "; --debug-refused shows refused rows"),
              file=stream)
    write_atomic(out_dir / HTML_FILE, debug_html(samples))
    print(f"wrote {out_dir / HTML_FILE}", file=stream)
    return samples


def diagnose(cfg: Config, *, stats: bool, debug: DebugOptions, out_dir: str | Path | None = None,
             stream: TextIO | None = None) -> dict:
    """Run the requested diagnostics; returns ``{"layout": yaml, "stats": …, "samples": …}`` for what ran."""
    from qlora_train.tokenizer import load_tokenizer_with_new_tokens

    stream = stream or sys.stdout
    out = Path(out_dir or cfg.train.output_dir)
    if out_dir is None:  # train.output_dir: ours, never a folder of the run's inputs (output_dir)
        claim_output_dir(out, run_inputs(cfg))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, new_tokens = load_tokenizer_with_new_tokens(cfg.model)
    result = {"layout": layout_report(tokenizer, out_dir=out, stream=stream)}
    if stats and not cfg.data.prepared_path:  # images' sizes from their headers: no pixel read
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"image_check": "header"})})
    raw, processed = diagnostic_rows(cfg, tokenizer)  # or the rows saved under data.prepared_path
    if stats:
        result["stats"] = stats_report(raw, processed, tokenizer, cfg, out_dir=out, stream=stream,
                                       new_tokens=new_tokens)
    if debug.samples:
        result["samples"] = debug_report(raw, processed, tokenizer, debug, out_dir=out, stream=stream, data=cfg.data,
                                         rollout=agent_rollouts(cfg, tokenizer))
    return result


def agent_rollouts(cfg: Config, tokenizer) -> Callable[[dict], str] | None:
    """With ``rl.tools`` (GRPO): a processed prompt row -> its scripted example rollout, marked
    (``diagnostics.rollouts``); the tools imported and the template's call format read as training does at start
    (``ToolError``, ``CallFormatError`` where they cannot be). None without tools."""
    if cfg.train.method != "grpo" or not cfg.rl.tools:
        return None
    from qlora_train.diagnostics.rollouts import example_rollout, format_example_rollout
    from qlora_train.rl.agent import AgentLimits, rl_call_format, rl_tools

    tools, fmt = rl_tools(cfg), rl_call_format(cfg, tokenizer)
    limits = AgentLimits(cfg.rl.max_turns, cfg.rl.tool_timeout_s, cfg.rl.tool_max_chars)

    def shown(row: dict) -> str:
        try:
            rollout = example_rollout(json.loads(row["prompt"]), list(row["input_ids"]), tokenizer, tools=tools,
                                      call_format=fmt, limits=limits)
        except Exception as exc:  # a diagnostic: say why there is no example, show the rest
            return f"example rollout: not built ({type(exc).__name__}: {exc})"
        return format_example_rollout(rollout, tokenizer, tool=tools[0].name)

    return shown
