"""Preprocessing throughput and packing efficiency, measured side by side on the same rows.

    python benchmarks/bench_preprocess.py [--rows 2000] [--batch-size 256] [--repeats 3]
    python benchmarks/bench_preprocess.py --scale 1000,20000     # per-row cost and peak RSS by size

Table 1, the pipeline against its floor (qwen3 template), with the tokenizer on one thread (1a: the
single-process ratio) and on its thread pool (1b; ``--tokenizer-threads`` picks):
  floor (HF call)  one ``apply_chat_template`` render per row + one batched fast-tokenizer call with offsets
                   per batch (``tokenizer(texts, return_offsets_mapping=True)``): the floor the issue names
  floor (Rust)     the same render + the Rust backend's ``encode_batch`` and its ids and offsets lists
  floor (ids only) the same render + ``encode_batch`` and its ids alone: no offsets read into Python (the
                   pipeline reads a few per row when the tokenizer keeps them in text order)
  pipeline         ``process_rows``: canonicalize, render, char mask + verification, batched tokenize,
                   projection to labels, truncation when needed; ``reasoning_history: drop``, so that it
                   renders each row once, like the floor
  pipeline (expand) the same with ``reasoning_history: expand`` (the default): more examples per row (each
                   earlier turn whose reasoning Qwen3 drops gets its own), so its time is printed per example
Table 2, reference points on the same rows with a generation-tagged ChatML template (benchmarks/
chatml_generation.jinja), each producing per-token assistant masks:
  pipeline         ``process_rows`` with that template
  HF assistant mask  ``apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)``,
                   batched per batch (rows grouped by their tools)
  prefix re-render mask spans found by rendering every prefix (2 renders per assistant turn), then one
                   batched tokenization (each text cut where a span starts, as the pipeline's) and the same
                   projection
Table 3, packing efficiency (real tokens / tokens processed) of the pipeline's examples: best-fit-decreasing
packing into ``--pack-length`` vs padding to the longest of each batch (random order).

Rows are generated deterministically (multi-turn, reasoning, tool calls, unicode, code); nothing is
downloaded. Timed runs are interleaved, best of ``--repeats``.

``--dists chat,reasoning,...`` (or ``all``) prints table 4 instead: per row distribution of ``bench_rows.py``
(rows nobody tuned the pipeline to, and their mix), the pipeline against the floor (HF call) with the tokenizer
on one thread, ``expand``'s cost per example against the pipeline's, and the pipeline against transformers'
assistant mask with the generation-tagged template (table 2's reference).

``--scale N1,N2,...`` runs each size in a fresh process through the real path (JSON lines file ->
``load_sources`` -> ``process_dataset``, a batched ``datasets.map`` writing the Arrow cache) and prints the
per-row cost and the peak RSS added by the map. Sizes are run ``--scale-repeats`` times, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_rows  # noqa: E402

from qlora_train.config import DataConfig  # noqa: E402
from qlora_train.data import canonicalize_row, process_rows  # noqa: E402
from qlora_train.data.packing import PackingStats, best_fit_decreasing, padded_efficiency  # noqa: E402
from qlora_train.masking.layout_declaration import template_layout  # noqa: E402
from qlora_train.masking.rendered import template_messages  # noqa: E402
from qlora_train.masking.tokenize import (  # noqa: E402
    IGNORE_INDEX,
    encode_batch,
    fast_encoder,
    keep_tokenizers,
    project_char_mask,
)
from qlora_train.tiny import build_qwen_tokenizer  # noqa: E402

GENERATION_TEMPLATE = Path(__file__).with_name("chatml_generation.jinja")
WORDS = ("the model reads each token and predicts the next one while the loss mask decides which "
         "positions count naïve café 東京 données 🙂 größe").split()
CODE = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n"
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def iter_rows(n: int, seed: int = 0):
    """``n`` deterministic rows, one at a time."""
    rng = random.Random(seed)
    for i in range(n):
        msgs = [{"role": "system", "content": sentence(rng, rng.randint(5, 30))}]
        for _ in range(rng.randint(1, 4)):
            msgs.append({"role": "user", "content": sentence(rng, rng.randint(5, 60))})
            if rng.random() < 0.25:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "search", "arguments": {"query": sentence(rng, 4)}}}]})
                msgs.append({"role": "tool", "content": json.dumps({"results": [sentence(rng, 12)]})})
            answer = sentence(rng, rng.randint(10, 120))
            if rng.random() < 0.3:
                answer += "\n\n```python\n" + CODE + "```"
            if rng.random() < 0.5:
                answer = f"<think>\n{sentence(rng, rng.randint(10, 80))}\n</think>\n\n{answer}"
            msgs.append({"role": "assistant", "content": answer})
        row = {"messages": msgs}
        if i % 4 == 0:
            row["tools"] = TOOLS
        yield row


def make_rows(n: int, seed: int = 0) -> list[dict]:
    return list(iter_rows(n, seed))


def batches(items: list, size: int):
    for s in range(0, len(items), size):
        yield items[s:s + size]


# --- the timed methods: each handles one batch and returns what it made ---


def hf_render(messages, tok, *, tools=None, add_generation_prompt=False) -> str:
    """The text ``process_rows`` renders, by ``apply_chat_template`` itself (the floor's render and the other
    methods'; the pipeline's own render skips transformers' copies, masking/apply_template.py)."""
    return tok.apply_chat_template(template_messages(messages, template_layout(tok)), tools=tools, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


def render_only(canon, tok) -> None:
    [hf_render(c.messages, tok, tools=c.tools) for c in canon]


def floor_fast(canon, tok) -> None:
    """The same render + the engine's encode step with the fast byte-level encoder (masking/fast_bpe.py): ids,
    and offsets worked out from the tokens' byte lengths (``ByteOffsets``)."""
    encode_batch([hf_render(c.messages, tok, tools=c.tools) for c in canon], tok)


def floor_hf(canon, tok) -> None:
    texts = [hf_render(c.messages, tok, tools=c.tools) for c in canon]
    tok(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)


def floor_rust(canon, tok) -> None:
    texts = [hf_render(c.messages, tok, tools=c.tools) for c in canon]
    [(e.ids, e.offsets) for e in tok._tokenizer.encode_batch(texts, add_special_tokens=False)]


def floor_ids(canon, tok) -> None:
    texts = [hf_render(c.messages, tok, tools=c.tools) for c in canon]
    [e.ids for e in tok._tokenizer.encode_batch(texts, add_special_tokens=False)]


def pipeline(rows, tok, cfg: DataConfig) -> list[list[int]]:
    out = process_rows(rows, tok, cfg)
    assert not any(out["drop_reason"]), set(out["drop_reason"])
    return out["labels"]


def pipeline_examples(rows, tok, cfg: DataConfig) -> list[int]:
    """``process_rows`` -> examples per row (1 + the extra ones of ``reasoning_history: expand``)."""
    out = process_rows(rows, tok, cfg)
    assert not any(out["drop_reason"]), set(out["drop_reason"])
    return [1 + len(extra) for extra in out["expanded_labels"]]


def hf_assistant_mask(canon, tok) -> list[list[int]]:
    """transformers' own masks; one batched call per distinct tools list in the batch."""
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(canon):
        groups.setdefault(json.dumps(c.tools), []).append(i)
    masks = [None] * len(canon)
    for idx in groups.values():
        out = tok.apply_chat_template([canon[i].messages for i in idx], tools=canon[idx[0]].tools,
                                      tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        for i, m in zip(idx, out["assistant_masks"]):
            masks[i] = m
    return masks


def prefix_spans(messages, tools, tok) -> tuple[str, list[tuple[int, int]]]:
    """Trained spans by prefix renders: turn i spans len(render(:i) + header) .. len(render(:i+1)) - newline."""
    text = hf_render(messages, tok, tools=tools)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            a = len(hf_render(messages[:i], tok, tools=tools, add_generation_prompt=True))
            b = len(hf_render(messages[:i + 1], tok, tools=tools).rstrip("\n"))
            spans.append((a, b))
    return text, spans


def prefix_rerender(canon, tok) -> list[list[int]]:
    import numpy as np

    rendered = [prefix_spans(c.messages, c.tools, tok) for c in canon]
    masks = []
    encoded = encode_batch([t for t, _ in rendered], tok, cuts=[[a for a, _ in spans] for _, spans in rendered])
    for (text, spans), (_, offsets) in zip(rendered, encoded):  # cut where each span starts, as the pipeline
        char_mask = np.zeros(len(text), dtype=np.uint8)
        for a, b in spans:
            char_mask[a:b] = 1
        mask = [0] * len(offsets)
        for a, b in project_char_mask(offsets, char_mask).runs:
            mask[a:b] = [1] * (b - a)
        masks.append(mask)
    return masks


def best_of(methods: dict, n_batches: int, repeats: int) -> tuple[dict, dict]:
    """Interleave the methods batch by batch (rotating who goes first), ``repeats`` times; keep each
    (method, batch)'s fastest time. -> (summed best seconds, outputs of the last repeat) per method.
    Taking the minimum per batch filters out bursts of load from other processes on a shared machine."""
    best = {name: [float("inf")] * n_batches for name in methods}
    outputs = {name: [None] * n_batches for name in methods}
    names = list(methods)
    for r in range(repeats):
        for k in range(n_batches):
            for j in range(len(names)):
                name = names[(j + k + r) % len(names)]
                fn, batches_, extra = methods[name]
                t = time.perf_counter()
                outputs[name][k] = fn(batches_[k], *extra)
                best[name][k] = min(best[name][k], time.perf_counter() - t)
    return ({name: sum(v) for name, v in best.items()},
            {name: [x for part in v for x in (part or [])] for name, v in outputs.items()})


def agreement(pipeline_labels, masks) -> tuple[float, int]:
    """-> (share of tokens where a reference mask says the same as the pipeline's labels, rows left out).

    Rows whose reference has another number of tokens are left out and counted: transformers' assistant mask
    tokenizes the render whole, so a turn whose first characters merge with its header's ("\\n" + "\\n<tool_call>")
    has a token fewer than the pipeline's render, cut where each trained turn begins."""
    same = total = apart = 0
    for labels, mask in zip(pipeline_labels, masks):
        if len(labels) != len(mask):
            apart += 1
            continue
        same += sum((lab != IGNORE_INDEX) == bool(m) for lab, m in zip(labels, mask))
        total += len(labels)
    return same / total, apart


def floor_line(best: dict, n_rows: int) -> str:
    """The floor's parts per row (ms): the render, tokenizing by each encoder (its floor less the render), and
    the pipeline by each, with their ratios."""
    ms = {k: 1000 * v / n_rows for k, v in best.items()}
    slow_tok, fast_tok = ms["floor (HF call)"] - ms["render"], ms["floor (fast)"] - ms["render"]
    return (f"per row (ms): render {ms['render']:.3f}; tokenize: tokenizers {slow_tok:.3f}, fast {fast_tok:.3f} "
            f"({slow_tok / fast_tok:.2f}x less); pipeline: tokenizers {ms['pipeline (tokenizers)']:.3f}, fast "
            f"{ms['pipeline']:.3f} ({ms['pipeline (tokenizers)'] / ms['pipeline']:.2f}x less); pipeline / floor "
            f"(fast) {ms['pipeline'] / ms['floor (fast)']:.3f}")


def print_table(title: str, n_rows: int, best: dict, ref: str) -> None:
    print(f"\n{title}")
    print(f"{'':<22} {'rows/s':>8} {'seconds':>8} {'time / ' + ref:>16}")
    for name, seconds in best.items():
        print(f"{name:<22} {n_rows / seconds:>8.0f} {seconds:>8.3f} {seconds / best[ref]:>16.3f}")


def main_tables(args) -> None:
    tok = build_qwen_tokenizer("qwen3")
    slow = build_qwen_tokenizer("qwen3")  # the same, encoded by tokenizers alone (the pipeline before issue 51)
    keep_tokenizers(slow)
    assert fast_encoder(tok, tok._tokenizer) is not None and fast_encoder(slow, slow._tokenizer) is None
    # like for like with the floor (one render per row): earlier turns' reasoning dropped, not expanded
    cfg = DataConfig(max_length=args.max_length, batch_size=args.batch_size, reasoning_history="drop")
    expand = cfg.model_copy(update={"reasoning_history": "expand"})
    rows = make_rows(args.rows)
    canon = [canonicalize_row(r, cfg) for r in rows]
    process_rows(rows[:8], tok, cfg)  # warm caches (template compile, layout probe)
    process_rows(rows[:8], slow, cfg)
    lengths = [len(ids) for ids, _ in encode_batch([hf_render(c.messages, tok, tools=c.tools) for c in canon], tok)]
    print(f"machine: {platform.machine()}, {args.cpus} CPU cores, python {platform.python_version()}; rows "
          f"{args.rows}, mean tokens/row {sum(lengths) / len(lengths):.0f}, batch {args.batch_size}, "
          f"best of {args.repeats} per batch, interleaved")

    row_batches = list(batches(rows, args.batch_size))
    canon_batches = list(batches(canon, args.batch_size))
    modes = {"on": ["true"], "off": ["false"], "both": ["false", "true"]}[args.tokenizer_threads]
    for mode in modes:
        # tokenizers reads this on every batched call: "false" = one thread, the single-process ratio;
        # "true" = its thread pool, which speeds up the floor's largest part as much as free cores allow
        os.environ["TOKENIZERS_PARALLELISM"] = mode
        best, results = best_of({
            "floor (HF call)": (floor_hf, canon_batches, (tok,)),
            "floor (Rust)": (floor_rust, canon_batches, (tok,)),
            "floor (ids only)": (floor_ids, canon_batches, (tok,)),
            "floor (fast)": (floor_fast, canon_batches, (tok,)),
            "render": (render_only, canon_batches, (tok,)),
            "pipeline": (pipeline, row_batches, (tok, cfg)),
            "pipeline (tokenizers)": (pipeline, row_batches, (slow, cfg)),
        }, len(row_batches), args.repeats)
        assert results["pipeline"] == results["pipeline (tokenizers)"]  # the same labels (and so ids) either way
        # measured on its own: it makes and leaves more objects, which would disturb the interleaved methods
        expand_best, expand_out = best_of({"pipeline (expand)": (pipeline_examples, row_batches, (tok, expand)),
                                           "pipeline": (pipeline, row_batches, (tok, cfg))},
                                          len(row_batches), args.repeats)
        threads = "one thread" if mode == "false" else "its thread pool"
        print_table(f"1{'ab'[modes.index(mode)] if len(modes) > 1 else ''}. pipeline vs floor (qwen3 template, "
                    f"tokenizer on {threads})", args.rows, best, "floor (HF call)")
        print(f"ratio pipeline / floor (HF call): {best['pipeline'] / best['floor (HF call)']:.3f}   "
              f"pipeline / floor (Rust): {best['pipeline'] / best['floor (Rust)']:.3f}   "
              f"pipeline / floor (ids only): {best['pipeline'] / best['floor (ids only)']:.3f}")
        print(floor_line(best, args.rows))
        n_examples = sum(expand_out["pipeline (expand)"])
        ratio = expand_best["pipeline (expand)"] / expand_best["pipeline"]
        print(f"reasoning_history: expand makes {n_examples} examples of {args.rows} rows "
              f"({n_examples / args.rows:.2f} per row): {ratio:.3f}x the pipeline's time, "
              f"{ratio * args.rows / n_examples:.3f}x per example (interleaved with the pipeline alone)")
    example_lengths = [len(lab) for lab in results["pipeline"]]

    gen = build_qwen_tokenizer("chatml")
    gen.chat_template = GENERATION_TEMPLATE.read_text()
    process_rows(rows[:8], gen, cfg)
    best, results = best_of({
        "pipeline": (pipeline, row_batches, (gen, cfg)),
        "HF assistant mask": (hf_assistant_mask, canon_batches, (gen,)),
        "prefix re-render": (prefix_rerender, canon_batches, (gen,)),
    }, len(row_batches), args.repeats)
    print_table("2. reference points (generation-tagged ChatML template, same rows)", args.rows, best, "pipeline")
    for name in ("HF assistant mask", "prefix re-render"):
        share, apart = agreement(results["pipeline"], results[name])
        print(f"{name}: mask agrees with the pipeline's labels on {share:.3%} of tokens"
              + (f" (of the rows tokenized alike; {apart} rows tokenized whole have fewer tokens)" if apart else ""))

    order = list(range(len(example_lengths)))
    random.Random(0).shuffle(order)
    shuffled = [example_lengths[i] for i in order]
    bins = best_fit_decreasing(example_lengths, args.pack_length)
    print(f"\n3. packing efficiency (real tokens / tokens processed), {len(example_lengths)} examples, "
          f"mean {sum(example_lengths) / len(example_lengths):.0f} tokens")
    print(f"packing into {args.pack_length}: {PackingStats.of(example_lengths, bins, args.pack_length).efficiency:.1%} "
          f"({len(bins)} sequences)")
    for b in (1, 4, 8, 16):
        print(f"padding to the longest of batches of {b:>2} (random order): {padded_efficiency(shuffled, b):.1%}")


STAGES = {  # what process_rows does, timed inside it: (module, name) of each stage
    "canonicalize": ("sft", "canonicalize_row"),
    "render": ("example", "render_conversation"),  # the template render + locating and verifying the spans
    "template": ("render", "render_text"),  # the template render alone (the floor's first part, made cheaper)
    "tokenize": ("example", "_encode_each"),  # the batched call with offsets (the floor's second part)
    "labels": ("sft", "_fit_chat"),  # projection to tokens, labels, tool block count
    "count": ("sft", "count_tokens"),  # tokens of the reasoning the template drops
    "dedup": ("sft", "content_hash"),  # data.dedup's content hash (timed with dedup on)
}


def stage_seconds(rows: list[dict], tok, cfg: DataConfig, args) -> dict[str, float]:
    """Seconds (best of ``args.repeats`` per batch) of each stage of ``STAGES`` inside ``process_rows`` (with
    ``data.dedup`` on), of the whole call (``process_rows``), of ``json.loads`` over the rows' JSON lines
    (``json``: the CLI's map parses each line; this bench hands ``process_rows`` parsed rows), and of the floor
    (``floor``, interleaved with them, the base of the shares). The rest of
    ``process_rows`` (``other``) is its bookkeeping: per-row guards and outputs, schema detection, the unicode
    check, the parse report."""
    from qlora_train.data import sft as sft_module
    from qlora_train.masking import example as example_module
    from qlora_train.masking import render as render_module

    modules = {"sft": sft_module, "example": example_module, "render": render_module}
    spent = dict.fromkeys(STAGES, 0.0)

    def timed(key, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapper

    lines = [[json.dumps(r, ensure_ascii=False) for r in b] for b in batches(rows, args.batch_size)]
    canon = list(batches([canonicalize_row(r, cfg) for r in rows], args.batch_size))
    dedup = cfg.model_copy(update={"dedup": True})
    saved = {key: getattr(modules[m], name) for key, (m, name) in STAGES.items()}
    for key, (m, name) in STAGES.items():
        setattr(modules[m], name, timed(key, saved[key]))
    best = {k: [float("inf")] * len(lines) for k in (*STAGES, "process_rows", "json", "floor")}
    try:
        for _ in range(args.repeats):
            for k, (batch, text) in enumerate(zip(batches(rows, args.batch_size), lines)):
                for key in STAGES:
                    spent[key] = 0.0
                t = time.perf_counter()
                [json.loads(line) for line in text]
                t2 = time.perf_counter()
                process_rows(batch, tok, dedup)
                t3 = time.perf_counter()
                floor_hf(canon[k], tok)
                measured = {**spent, "json": t2 - t, "process_rows": t3 - t2, "floor": time.perf_counter() - t3}
                for key, v in measured.items():
                    best[key][k] = min(best[key][k], v)
    finally:
        for key, (m, name) in STAGES.items():
            setattr(modules[m], name, saved[key])
    out = {key: sum(v) for key, v in best.items()}
    out["verify"] = out.pop("render") - out["template"]
    out["other"] = out["process_rows"] - sum(out[k] for k in ("canonicalize", "verify", "template", "tokenize",
                                                               "labels", "count", "dedup"))
    return out


SHARES = ("json", "canonicalize", "verify", "labels", "count", "dedup", "other")


def distribution_table(args) -> None:
    """Table 4: per distribution, the ratios of tables 1a and 2 and expand's cost per example."""
    names = list(bench_rows.NAMES) if args.dists == "all" else args.dists.split(",")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = build_qwen_tokenizer("qwen3")
    gen = build_qwen_tokenizer("chatml")
    gen.chat_template = GENERATION_TEMPLATE.read_text()
    cfg = DataConfig(max_length=args.max_length, batch_size=args.batch_size, reasoning_history="drop")
    expand = cfg.model_copy(update={"reasoning_history": "expand"})
    print(f"machine: {platform.machine()}, {args.cpus} CPU cores, python {platform.python_version()}; rows "
          f"{args.rows} per distribution, batch {args.batch_size}, best of {args.repeats} per batch, interleaved; "
          "tokenizer on one thread")
    print("\n4. per row distribution (bench_rows.py): pipeline / floor (HF call) as table 1a, expand per example / "
          "pipeline, pipeline / HF assistant mask as table 2; then the work the floor does not do, timed inside "
          "process_rows (data.dedup on), as a share of the floor's time: json = json.loads of the rows' JSON lines "
          "(the CLI's map parses them), canonicalize, verify = locating and verifying the spans in the render, "
          "labels = projection to tokens and labels, count = the tokens of the reasoning the template drops, dedup "
          "= the content hash, other = the rest of process_rows (guards, outputs, schema detection, unicode check, "
          "parse report)")
    print(f"{'distribution':<12} {'tokens/row':>10} {'floor us/row':>12} {'pipeline/floor':>14} "
          f"{'examples/row':>12} {'expand/ex':>9} {'pipeline/HF mask':>16} {'HF agrees':>9}"
          + "".join(f" {k[:7]:>7}" for k in SHARES))
    for name in names:
        rows = bench_rows.rows(name, args.rows)
        canon = [canonicalize_row(r, cfg) for r in rows]
        process_rows(rows[:8], tok, cfg)
        process_rows(rows[:8], gen, cfg)
        row_batches, canon_batches = list(batches(rows, args.batch_size)), list(batches(canon, args.batch_size))
        best, results = best_of({"floor (HF call)": (floor_hf, canon_batches, (tok,)),
                                 "pipeline": (pipeline, row_batches, (tok, cfg))}, len(row_batches), args.repeats)
        lengths = [len(lab) for lab in results["pipeline"]]
        ex_best, ex_out = best_of({"pipeline (expand)": (pipeline_examples, row_batches, (tok, expand)),
                                   "pipeline": (pipeline, row_batches, (tok, cfg))}, len(row_batches), args.repeats)
        n_examples = sum(ex_out["pipeline (expand)"])
        per_example = ex_best["pipeline (expand)"] / ex_best["pipeline"] * args.rows / n_examples
        hf_best, hf_out = best_of({"pipeline": (pipeline, row_batches, (gen, cfg)),
                                   "HF assistant mask": (hf_assistant_mask, canon_batches, (gen,))},
                                  len(row_batches), args.repeats)
        floor = best["floor (HF call)"]
        stages = stage_seconds(rows, tok, cfg, args)
        print(f"{name:<12} {sum(lengths) / len(lengths):>10.0f} {floor / args.rows * 1e6:>12.0f} "
              f"{best['pipeline'] / floor:>14.3f} {n_examples / args.rows:>12.2f} "
              f"{per_example:>9.3f} {hf_best['pipeline'] / hf_best['HF assistant mask']:>16.3f} "
              f"{agreement(hf_out['pipeline'], hf_out['HF assistant mask'])[0]:>9.3%}"
              + "".join(f" {stages[k] / stages['floor']:>7.1%}" for k in SHARES), flush=True)


# --- scale: each size in its own process, through datasets.map ---


class PeakMemory:
    """Samples this process's resident memory every 20 ms while active (Linux /proc): anonymous memory
    (the Python heap, Arrow buffers) apart from file-backed pages (memory-mapped Arrow files, which the
    kernel can drop at will)."""

    def __init__(self):
        import threading

        self.anon = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> tuple[int, int]:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(fields["RssAnon"].split()[0]) // 1024, int(fields["RssFile"].split()[0]) // 1024

    def _run(self):
        while not self._stop.is_set():
            anon, file = self.read()
            self.anon, self.file = max(self.anon, anon), max(self.file, file)
            self._stop.wait(0.02)

    def __enter__(self):
        self.anon_before, self.file_before = self.read()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def scale_worker(n: int, batch_size: int, dist: str = "bench") -> None:
    from qlora_train.config import DatasetSource
    from qlora_train.data.dataset import process_dataset
    from qlora_train.data.sources import load_sources

    tok = build_qwen_tokenizer("qwen3")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        with path.open("w") as fh:
            for row in bench_rows.iter_rows(dist, n):
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        cfg = DataConfig(datasets=[DatasetSource(path=str(path))], batch_size=batch_size, max_length=4096,
                         cache_dir=str(Path(tmp) / "cache"))
        raw = load_sources(cfg.datasets, cache_dir=cfg.cache_dir)
        process_dataset(raw.select(range(8)), tok, cfg)  # warm up: imports, template compile, layout probe
        t, c = time.perf_counter(), time.process_time()
        process_dataset(raw.select(range(8, 24)), tok, cfg)  # the fixed cost of one map call (hashing, files)
        fixed, fixed_cpu = time.perf_counter() - t, time.process_time() - c
        with PeakMemory() as mem:
            t, c = time.perf_counter(), time.process_time()
            out = process_dataset(raw, tok, cfg)
            seconds, cpu = time.perf_counter() - t, time.process_time() - c
        assert len(out) == n
    print(json.dumps({"rows": n, "seconds": seconds, "cpu": cpu, "fixed": fixed, "fixed_cpu": fixed_cpu,
                      "anon_before_mb": mem.anon_before, "anon_peak_mb": mem.anon, "file_peak_mb": mem.file,
                      "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main_scale(args) -> None:
    """CPU time of this process (all its threads) is the measure: on a shared machine wall time mostly
    measures the neighbours. Wall time is printed beside it."""
    sizes = [int(s) for s in args.scale.split(",")]
    best: dict[int, dict] = {}
    for _ in range(args.scale_repeats):
        for n in sizes:
            proc = subprocess.run([sys.executable, __file__, "--scale-worker", str(n), "--batch-size",
                                   str(args.batch_size), "--scale-dist", args.scale_dist],
                                  capture_output=True, text=True, check=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            if n not in best or r["cpu"] < best[n]["cpu"]:
                best[n] = r
    print(f"machine: {platform.machine()}, {args.cpus} CPU cores, python {platform.python_version()}; "
          f"{args.scale_dist} rows, JSON lines -> load_sources -> process_dataset (datasets.map, num_proc=None, batch "
          f"{args.batch_size}), best of {args.scale_repeats} by CPU time, one process per run")
    print("cpu us/row = (CPU seconds of the map - CPU seconds of one 16-row map, its fixed cost) / rows; "
          "memory in MB, sampled during the map: anonymous (heap) before and at peak, file-backed (mmap) at peak")
    print(f"{'rows':>8} {'wall s':>7} {'cpu s':>7} {'fixed cpu':>9} {'cpu us/row':>10} {'vs first':>9} "
          f"{'anon before':>11} {'anon peak':>9} {'added':>6} {'file peak':>9}")
    first = None
    for n in sizes:
        r = best[n]
        per_row = (r["cpu"] - r["fixed_cpu"]) / n
        first = first or per_row
        print(f"{n:>8} {r['seconds']:>7.2f} {r['cpu']:>7.2f} {r['fixed_cpu']:>9.2f} {per_row * 1e6:>10.0f} "
              f"{per_row / first:>9.3f} {r['anon_before_mb']:>11} {r['anon_peak_mb']:>9} "
              f"{r['anon_peak_mb'] - r['anon_before_mb']:>6} {r['file_peak_mb']:>9}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pack-length", type=int, default=4096)
    ap.add_argument("--tokenizer-threads", choices=["on", "off", "both"], default="both",
                    help="table 1 with tokenizers' thread pool on, off (single thread), or both")
    ap.add_argument("--dists", help="table 4 only, for these row distributions of bench_rows.py (or all)")
    ap.add_argument("--scale", help="comma-separated row counts, e.g. 1000,20000 (or 1000,100000)")
    ap.add_argument("--scale-repeats", type=int, default=3)
    ap.add_argument("--scale-dist", default="bench", help="the rows of --scale: a name of bench_rows.NAMES")
    ap.add_argument("--scale-worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.cpus = os.cpu_count()
    if args.scale_worker:
        scale_worker(args.scale_worker, args.batch_size, args.scale_dist)
    elif args.scale:
        main_scale(args)
    elif args.dists:
        distribution_table(args)
    else:
        main_tables(args)


if __name__ == "__main__":
    main()
