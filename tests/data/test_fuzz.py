"""Fuzz of the whole row path (issue 35): hostile files -> the readers -> process_rows -> trained tokens.

Rows are drawn as a careless or hostile data source writes them: chat rows and preference pairs with the
template's own markers inside every field (roles, names, tool-call names, argument keys and values, content,
reasoning, tool output, tool schemas), wrong types at every level, huge strings; then written to files as
JSON lines or ``.json`` arrays with invalid UTF-8 bytes, lone surrogates (raw and as ``\\ud800`` escapes), NULs,
integers of more than 4,300 digits, nesting 5,000 deep, cut lines and blank ones. The files are read by the
real readers (``sources._json_rows``; ``dataset.load_and_process_sources`` with ``datasets`` end to end) and
processed batch by batch as a run does (``dataset._process_raw_batch``: ``batches.parse_readable``,
``pipeline.process_rows``, the pair path with ``objective: preference``). Asserted for every drawn file set:

- nothing escapes: no exception, and no row refused by an unexpected exception (``error_traceback``: a bug in
  our code, or a template's own exception taken for one);
- accounting: per source, one processed row per row written (a ``.json`` array that cannot be read at all is
  one row), each kept or refused under a known reason with a detail naming its file and line;
- nothing but generated text is trained: every kept row's trained tokens against the prefix-render rule as
  the tests apply it (``tests/masking/oracle.py``), no token trained the rule does not train; where the rule cannot
  decide the row, no token trained inside a user, system or tool message's content.

On three templates x vocabularies: the Qwen3 vocabulary (the tiny Qwen3's) with our qwen3 template, the
real Llama 3 vocabulary with the template it ships, and the real Llama 3 vocabulary with the qwen3 template
(its markers plain text, several tokens each).

CI runs a small derandomized slice (the ``ci`` profile of tests/conftest.py). ``make fuzz`` runs the same
tests for ``FUZZ_SECONDS`` (shared out over the tests and the xdist workers), on new examples each time. Each
failure found is kept at the end of this file as its minimal example, a regression test once it is fixed.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from qlora_train.config import DataConfig, DatasetSource
from qlora_train.data.dataset import _process_raw_batch, summarize_columns
from qlora_train.data.drops import KNOWN_DROP_REASONS
from qlora_train.data.pairs import canonicalize_pair
from qlora_train.data.parse import canonicalize_row
from qlora_train.data.processed import SFT_ROW
from qlora_train.data.sources import SourceError, _json_rows
from qlora_train.data.unpaired import canonicalize_unpaired
from qlora_train.masking import IGNORE_INDEX, LossPolicy
from tests.masking.oracle import (
    DECIDED,
    REFUSE,
    check_kept_row,
    pair_oracle,
    prefix_oracle,
    tokens,
    weak_violations,
)

# ---------------------------------------------------------------------------------------------- run length
# FUZZ_SECONDS (make fuzz): the whole budget, shared out over the fuzz tests and the xdist workers; each test
# draws chunks of new examples until its share is spent. Without it: the CI slice, a few examples per test
# (derandomized under CI by the ``ci`` profile of tests/conftest.py).
FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS") or 0)
FUZZ_TESTS = 5  # the tests below that call ``explore``, each x TARGETS
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
CHUNK = 20  # examples per hypothesis run in a FUZZ_SECONDS run (the budget is looked at between runs)


def explore(body, slice_examples: int, chunk: int = CHUNK) -> None:
    """Run ``body(data)`` (a hypothesis ``st.data()`` draw) as a property: ``slice_examples`` examples in the CI
    slice; with FUZZ_SECONDS, runs of ``CHUNK`` new examples until this test's share of the time is spent.
    FUZZ_NO_SHRINK=1 reports a failure as found, unshrunk (faster while exploring)."""
    common = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True, database=None)
    if os.environ.get("FUZZ_NO_SHRINK"):
        common["phases"] = [Phase.explicit, Phase.reuse, Phase.generate]
    if not FUZZ_SECONDS:
        settings(max_examples=slice_examples, **common)(given(data=st.data())(_fresh(body)))()
        return
    end = time.monotonic() + FUZZ_SECONDS * WORKERS / (FUZZ_TESTS * len(TARGETS))
    while time.monotonic() < end:
        settings(max_examples=chunk, derandomize=False, **common)(given(data=st.data())(_fresh(body)))()


def _fresh(body):
    """``body`` as a new function: each hypothesis run gets its own (settings attach to the function)."""
    def prop(data):
        body(data)
    return prop


# ---------------------------------------------------------------------------------------------- targets
TARGETS = ("qwen3", "llama3", "qwen3-on-llama3")


@pytest.fixture(scope="module", params=TARGETS)
def target(request, qwen3_tok, real_vocab_dir):
    """(name, tokenizer, end markers, the template's markers for hostile rows)."""
    from tests.vocabularies import tokenizer_with_template

    name = request.param
    if name == "qwen3":
        tok, ends = qwen3_tok, ("<|im_end|>",)
    elif name == "llama3":
        from transformers import PreTrainedTokenizerFast

        tok, ends = PreTrainedTokenizerFast.from_pretrained(real_vocab_dir("llama3")), ("<|eot_id|>",)
    else:
        tok = tokenizer_with_template(real_vocab_dir("llama3"), qwen3_tok.chat_template, eos_token="<|im_end|>")
        ends = ("<|im_end|>",)
    template = tok.chat_template
    added = sorted(t for t in tok.get_added_vocab() if t.strip() and t in template)
    plain = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
             "</tool_response>", "<tools>", "</tools>"] if "<|im_start|>" in template else []
    header = _header(tok)
    markers = tuple(dict.fromkeys([*added, *plain, *ends, *([header] if header else [])]))
    return name, tok, ends, markers


def _header(tok) -> str:
    user = [{"role": "user", "content": "hi"}]
    plain = tok.apply_chat_template(user, tokenize=False)
    prompted = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    return prompted[len(plain):] if prompted.startswith(plain) else ""


# ---------------------------------------------------------------------------------------------- rows
# sentinels a row may hold anywhere a value goes; replaced in its JSON text by what json.dumps cannot write
HUGE_INT, DEEP, BIG_FLOAT = "\x00HUGE_INT\x00", "\x00DEEP\x00", "\x00BIG_FLOAT\x00"
RAW = {json.dumps(HUGE_INT): "9" * 5000, json.dumps(DEEP): "[" * 5000 + "]" * 5000,
       json.dumps(BIG_FLOAT): "1e999"}
# JSON inside a string (tool-call arguments, tool_calls, tools): parsed again by the parse stage
JSON_BOMBS = {"huge_int": '{"a": ' + "9" * 5000 + "}", "deep": "[" * 5000 + "]" * 5000}
# values a crash found by the fuzz was seen with, left out of the fuzz until it is fixed (each kept as an
# xfail(strict=True) test below; when one passes, its entry goes and the fuzz draws it again): none now
KNOWN_CRASHES: dict = {}
SENTINELS = [v for v in (HUGE_INT, DEEP, BIG_FLOAT) if v not in KNOWN_CRASHES]
BOMBS = [v for k, v in JSON_BOMBS.items() if {"huge_int": HUGE_INT, "deep": DEEP}[k] not in KNOWN_CRASHES]
PIECES = ["{{", "{%", "}}", "\n", " ", "\t", "\ud800", "\udcff", "é", "🙂", "\x00", "\x1b]0;x\x07\x1b[2J", "\\u",
          "answer", "Paris", "<think>", "</think>", "\u2028", "\x85"]
words = st.sampled_from(["Paris.", "ok", "the answer is 4", "  spaced  ", "é 中 🙂", "line\nline"])


def hostile_texts(markers):
    piece = st.sampled_from(markers) | st.sampled_from(PIECES) | st.text(max_size=6) | words
    return st.one_of(
        words,
        st.lists(piece, min_size=1, max_size=6).map("".join),
        st.builds(lambda a, m, b: f"{a}{m}{b}", words, st.sampled_from(markers), words),
        st.sampled_from(["x" * 20_000, "word " * 3000, "🙂" * 5000]),
    )


def garbage(texts):
    scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | texts
               | st.sampled_from([*SENTINELS, *BOMBS] or [None]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(texts | st.text(max_size=6), inner, max_size=3), max_leaves=6)


@st.composite
def conversation(draw, markers):
    """A chat conversation and its tools: markers in every field, drawn so that most rows still parse."""
    text = hostile_texts(markers)

    def role(r: str) -> str:  # one in ten a marker or hostile text
        return r if draw(st.integers(0, 9)) else draw(st.sampled_from([f"{r}{m}" for m in markers]) | text)

    msgs, tools = [], None
    if draw(st.booleans()):
        msgs.append({"role": role("system"), "content": draw(text)})
    for _ in range(draw(st.integers(1, 3))):
        msgs.append({"role": role("user"), "content": draw(text)})
        if draw(st.integers(0, 3)) == 0:  # a tool call, its result, then the answer
            name = draw(st.sampled_from(["get", "add"]) | text)
            key = draw(st.sampled_from(["city", "a"]) | text)
            args = {key: draw(text | st.integers() | st.sampled_from(SENTINELS or [None]))}
            call = {"type": "function", "function": {"name": name, "arguments": draw(
                st.sampled_from([args, json.dumps(args, ensure_ascii=False), *BOMBS]))}}
            if draw(st.booleans()):
                call["id"] = draw(text)
            msgs.append({"role": role("assistant"), "content": draw(st.just("") | text), "tool_calls": [call]})
            tool = {"role": role("tool"), "content": draw(text)}
            if draw(st.booleans()):
                tool["name"] = draw(text)
            msgs.append(tool)
            tools = [{"type": "function", "function": {
                "name": draw(text), "description": draw(text),
                "parameters": {"type": "object", "properties": {draw(text): {"type": "string"}}}}}]
        answer = {"role": role("assistant"), "content": draw(text)}
        if draw(st.booleans()):
            answer[draw(st.sampled_from(["reasoning_content", "reasoning", "thinking"]))] = draw(text)
        if draw(st.integers(0, 5)) == 0:
            answer["name"] = draw(text)
        msgs.append(answer)
    return msgs, tools


def _paths(node, path=()):
    """Every (path, value) inside a JSON-like row."""
    yield path, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, path + (key,))


@st.composite
def mutated(draw, row, texts):
    """``row`` with zero to three places replaced by garbage (a wrong type at any level) or removed."""
    row = copy.deepcopy(row)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2, 3]))):
        paths = [p for p, _ in _paths(row) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = row
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()):
            parent[path[-1]] = draw(garbage(texts))
        elif isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    return row


@st.composite
def sft_rows(draw, markers):
    msgs, tools = draw(conversation(markers))
    text = hostile_texts(markers)
    shape = draw(st.sampled_from(["messages", "messages", "messages", "bare", "sharegpt", "prompt_response",
                                  "garbage"]))
    if shape == "messages":
        row = {"messages": msgs, **({"tools": draw(st.sampled_from([tools, json.dumps(tools), *BOMBS]))}
                                    if tools else {})}
    elif shape == "bare":
        row = msgs
    elif shape == "sharegpt":
        names = {"user": "human", "assistant": "gpt"}
        row = {"conversations": [{"from": names.get(m["role"], m["role"]), "value": m["content"]} for m in msgs]}
    elif shape == "prompt_response":
        row = {"prompt": draw(text), "response": draw(text)}
    else:
        row = draw(garbage(text))
    return draw(mutated(row, text))


@st.composite
def pair_rows(draw, markers):
    msgs, tools = draw(conversation(markers))
    text = hostile_texts(markers)
    last_user = max((k for k, m in enumerate(msgs) if m["role"] == "user"), default=0)
    prompt, chosen = msgs[:last_user + 1], msgs[last_user + 1:]
    rejected = [{"role": "assistant", "content": draw(text)}]
    shape = draw(st.sampled_from(["messages", "messages", "strings", "implicit", "hh", "garbage"]))
    if shape == "messages":
        row = {"prompt": prompt, "chosen": chosen, "rejected": rejected, **({"tools": tools} if tools else {})}
    elif shape == "strings":
        row = {"prompt": draw(text), "chosen": draw(text), "rejected": draw(text)}
        if draw(st.booleans()):
            row["system"] = draw(text)
    elif shape == "implicit":
        row = {"chosen": prompt + chosen, "rejected": prompt + rejected}
    elif shape == "hh":
        row = {side: f"\n\nHuman: {draw(text)}\n\nAssistant: {draw(text)}" for side in ("chosen", "rejected")}
    else:
        row = draw(garbage(text))
    if draw(st.integers(0, 4)) == 0:
        row = {**row, "score_chosen": draw(garbage(text)), "score_rejected": 1} if isinstance(row, dict) else row
    return draw(mutated(row, text))


@st.composite
def unpaired_rows(draw, markers):
    """KTO rows: a prompt (the conversation up to its last user turn), its completion and a label."""
    msgs, tools = draw(conversation(markers))
    text = hostile_texts(markers)
    last_user = max((k for k, m in enumerate(msgs) if m["role"] == "user"), default=0)
    label = draw(st.sampled_from([True, False, 1, 0]) | garbage(text))
    shape = draw(st.sampled_from(["messages", "messages", "strings", "garbage"]))
    if shape == "messages":
        row = {"prompt": msgs[:last_user + 1], "completion": msgs[last_user + 1:], "label": label,
               **({"tools": tools} if tools else {})}
    elif shape == "strings":
        row = {"prompt": draw(text), "completion": draw(text), "label": label}
        if draw(st.booleans()):
            row["system"] = draw(text)
    else:
        row = draw(garbage(text))
    return draw(mutated(row, text))


# ---------------------------------------------------------------------------------------------- files
LINE_EDITS = ("none", "none", "none", "ascii", "raw_surrogate", "bad_bytes", "nul_byte", "cut", "bom")


@st.composite
def json_line(draw, row):
    """``row`` as the bytes of one JSON line (no line break inside), edited as careless writers do: sentinels
    replaced by huge integers, deep nesting and ``1e999``; lone surrogates written raw (invalid UTF-8) or as
    escapes; invalid bytes, a NUL byte or a BOM inserted; the line cut short."""
    edit = draw(st.sampled_from(LINE_EDITS))
    text = json.dumps(row, ensure_ascii=edit == "ascii")
    for sentinel, raw in RAW.items():
        text = text.replace(sentinel, raw)
    data = text.encode("utf-8", "surrogatepass")  # lone surrogates (ensure_ascii=False) as invalid UTF-8
    at = draw(st.integers(0, len(data)))
    if edit == "bad_bytes":
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x80\x80"])) + data[at:]
    elif edit == "nul_byte":
        data = data[:at] + b"\x00" + data[at:]
    elif edit == "bom":
        data = b"\xef\xbb\xbf" + data
    elif edit == "cut":
        data = data[:at]
    return data.replace(b"\n", b"").replace(b"\r", b"")  # one row, one line (raw breaks: test_raw_line_breaks)


@st.composite
def source_file(draw, rows):
    """(file name, bytes, rows written): JSON lines (blank lines between some), or a ``.json`` array (one row when
    the file does not parse as a whole: it cannot be read row by row)."""
    lines = [draw(json_line(row)) for row in draw(st.lists(rows, min_size=1, max_size=5))]
    if draw(st.integers(0, 3)) == 0:
        body = b"[" + b",\n".join(lines) + b"]"
        try:
            n = {len(json.loads(body.decode("utf-8", "surrogateescape")))}
        except json.JSONDecodeError:  # a cut or edited row: its elements counted one by one, or where the
            # array's frame itself is broken (a string or bracket never closed) a SourceError naming the file
            # (or as JSON lines of bare lists, where its first line ends like one: the reader cannot tell). A row
            # cut inside a string runs on into the rows after it until a quote closes it: the elements found (each
            # counted, a bad one as unparseable_json naming its line) may be fewer than the rows written
            n = {*range(1, len(lines) + 1), SOURCE_ERROR}
        except (ValueError, RecursionError):  # a huge integer, deep nesting: the file, or each row counted (or,
            n = {1, len(lines), SOURCE_ERROR}  # with a cut besides, a frame the reader cannot find: named)
        return "rows.json", body, n
    blank = draw(st.sampled_from([b"", b"\n", b"  \t\n"]))
    body = b"".join(line + b"\n" + (blank if k % 2 else b"") for k, line in enumerate(lines))
    return "rows.jsonl", body, {sum(1 for line in lines if line.strip(b" \t"))}


# ---------------------------------------------------------------------------------------------- the checks
SFT = DataConfig(max_length=8192, reasoning_history="drop", batch_size=4)  # oracle-checked: nothing truncated
PAIRS = DataConfig(objective="preference", max_length=8192, batch_size=4)
UNPAIRED = DataConfig(objective="unpaired", max_length=8192, batch_size=4)
configs = {
    "sft": st.sampled_from([SFT, SFT, DataConfig(max_length=48, on_too_long="truncate"),
                            DataConfig(max_length=48, on_too_long="drop", think_loss="answer_only", dedup=True),
                            DataConfig(rule_check="all", max_length=8192),
                            DataConfig(reasoning_history="expand", think_mode="keep", max_length=8192)]),
    "preference": st.sampled_from([PAIRS, PAIRS, DataConfig(objective="preference", max_length=64),
                                   DataConfig(objective="preference", max_length=8192, rule_check="all",
                                              min_score_margin=0.5)]),
    "unpaired": st.sampled_from([UNPAIRED, UNPAIRED, DataConfig(objective="unpaired", max_length=64),
                                 DataConfig(objective="unpaired", max_length=8192, rule_check="all")]),
}


def process_file(path: Path, tok, cfg: DataConfig, label: str = "0:src") -> dict[str, list]:
    """The file read as a run reads it (``_json_rows``) and processed batch by batch (``_process_raw_batch``)."""
    raw = list(_json_rows([str(path)]))
    out: dict[str, list] = {}
    for at in range(0, len(raw), cfg.batch_size):
        chunk = raw[at:at + cfg.batch_size]
        batch = {k: [r[k] for r in chunk] for k in ("row", "location", "load_error")} | {"source": [label] * len(chunk)}
        table = _process_raw_batch(batch, list(range(at, at + len(chunk))), tok, cfg)
        for col, values in table.to_pydict().items():
            out.setdefault(col, []).extend(values)
    out["row"] = [r["row"] for r in raw]
    return out


def check_accounting(out: dict[str, list], written: set[int], file_name: str) -> None:
    """One processed row per row written (``written``: the counts that are right), each kept or refused for a
    known reason naming its file, no unexpected exception; the report's counts add up."""
    n = len(out.get("drop_reason", []))
    assert n in written, f"{written} rows written, {n} processed"
    if n == 0:
        return
    unexpected = [d for d, tb in zip(out["drop_detail"], out["error_traceback"]) if tb]
    assert not unexpected, f"rows refused by an unexpected exception (a bug): {unexpected[:3]}"
    for reason, detail in zip(out["drop_reason"], out["drop_detail"]):
        if reason:
            assert reason in KNOWN_DROP_REASONS, reason
            assert file_name in detail, detail
    report = summarize_columns(out)
    assert report.rows_in == n
    assert report.rows_kept + sum(report.dropped.values()) == n
    assert report.rows_kept == sum(1 for r in out["drop_reason"] if not r)


def _trained(labels) -> list[bool]:
    return [lab != IGNORE_INDEX for lab in labels]


def check_sft_masks(out: dict[str, list], tok, cfg: DataConfig, ends) -> None:
    """Every kept, untruncated row's trained tokens against the rule (``prefix_oracle``)."""
    policy = LossPolicy.of(cfg)
    for i, reason in enumerate(out["drop_reason"]):
        if reason:
            continue
        ids, labels = out["input_ids"][i], out["labels"][i]
        assert len(ids) == len(labels) and any(_trained(labels))
        assert all(lab in (IGNORE_INDEX, t) for lab, t in zip(labels, ids))
        if out["num_tokens_before"][i] != len(ids) or cfg is not SFT:
            continue  # truncated, or a policy the oracle does not apply
        canon = canonicalize_row(json.loads(out["row"][i]), cfg, tokenizer=tok, policy=policy)
        if canon.messages[0]["role"] == "assistant":
            continue  # the oracle renders the empty prompt before it, which apply_chat_template refuses
        verdict = prefix_oracle(tok, canon.messages, tools=canon.tools, end_markers=ends)
        check = check_kept_row(tok, verdict, canon.messages, ids, _trained(labels))
        where = out["location"][i]
        assert not check.text_differs, f"{where}: the engine's ids are not the render's tokens"
        assert verdict.kind != REFUSE, f"{where}: kept, but the rule refuses it: {verdict.reason}"
        assert check.wrong == 0, f"{where}: {check.wrong} tokens trained that the rule does not train"
        if verdict.kind != DECIDED:
            assert check.weak == 0, f"{where}: {check.weak} tokens trained inside a user, system or tool content"
        _, offsets = tokens(tok, verdict.text, verdict.cuts)
        assert weak_violations(verdict.text, [m for m in canon.messages if m["role"] != "assistant"], offsets,
                               _trained(labels)) == 0, f"{where}: a user, system or tool character trained"


def check_pair_masks(out: dict[str, list], tok, cfg: DataConfig, ends) -> None:
    """Both sides of every kept, untruncated pair against the rule, the response's turns alone trained."""
    for i, reason in enumerate(out["drop_reason"]):
        if reason or cfg is not PAIRS or out["num_tokens_before"][i] != out["num_tokens"][i]:
            continue
        pair = canonicalize_pair(json.loads(out["row"][i]), cfg, tokenizer=tok)
        if not pair.prompt:
            continue  # the oracle renders the empty prompt before the response, which apply_chat_template refuses
        verdicts = pair_oracle(tok, pair.prompt, {"chosen": pair.chosen, "rejected": pair.rejected}, tools=pair.tools,
                               end_markers=ends)
        for side, response in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            msgs = pair.prompt + response
            trained_range = range(len(pair.prompt), len(msgs))
            verdict = verdicts[side]
            labels = out[f"{side}_labels"][i]
            check = check_kept_row(tok, verdict, msgs, out[f"{side}_input_ids"][i], _trained(labels),
                                   trained_messages=trained_range)
            where = f"{out['location'][i]} {side}"
            assert not check.text_differs, f"{where}: the engine's ids are not the render's tokens"
            assert verdict.kind != REFUSE, f"{where}: kept, but the rule refuses it: {verdict.reason}"
            assert check.wrong == 0 and check.weak == 0, f"{where}: {check} (tokens trained the rule does not)"


def check_unpaired_masks(out: dict[str, list], tok, cfg: DataConfig, ends) -> None:
    """Every kept unpaired row: its labels its ids or -100, nothing trained in its prompt; an untruncated one's
    completion against the rule, its turns alone trained."""
    for i, reason in enumerate(out["drop_reason"]):
        if reason:
            continue
        ids, labels, p = out["input_ids"][i], out["labels"][i], out["prompt_length"][i]
        assert len(ids) == len(labels) and any(_trained(labels)) and not any(_trained(labels[:p]))
        assert all(lab in (IGNORE_INDEX, t) for lab, t in zip(labels, ids))
        if cfg is not UNPAIRED or out["num_tokens_before"][i] != out["num_tokens"][i]:
            continue
        row = canonicalize_unpaired(json.loads(out["row"][i]), cfg, tokenizer=tok)
        if not row.prompt:
            continue  # the oracle renders the empty prompt before the completion, which apply_chat_template refuses
        msgs = row.prompt + row.completion
        trained_range = range(len(row.prompt), len(msgs))
        verdict = prefix_oracle(tok, msgs, tools=row.tools, end_markers=ends, trained=trained_range)
        check = check_kept_row(tok, verdict, msgs, ids, _trained(labels), trained_messages=trained_range)
        where = out["location"][i]
        assert not check.text_differs, f"{where}: the engine's ids are not the render's tokens"
        assert verdict.kind != REFUSE, f"{where}: kept, but the rule refuses it: {verdict.reason}"
        assert check.wrong == 0 and check.weak == 0, f"{where}: {check} (tokens trained the rule does not)"


SOURCE_ERROR = -1  # in a drawn file's row counts: the reader may stop with a SourceError naming the file


def run_file(target, cfg, name, data, written):
    """One drawn file through the row path, and every check."""
    _, tok, ends, _ = target
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        try:
            out = process_file(path, tok, cfg)
        except SourceError as err:  # a .json array whose frame is broken: the run stops, naming the file
            assert SOURCE_ERROR in written and str(path) in str(err), f"{written} rows written: {err}"
            return
    check_accounting(out, written, name)
    if not out.get("drop_reason"):  # a file without rows (a run stops on it: test_sources_end_to_end)
        return
    if cfg.objective == "preference":
        check_pair_masks(out, tok, cfg, ends)
    elif cfg.objective == "unpaired":
        check_unpaired_masks(out, tok, cfg, ends)
    else:
        check_sft_masks(out, tok, cfg, ends)


# ---------------------------------------------------------------------------------------------- the tests
def test_sft_files_through_the_row_path(target):
    def body(data):
        name, raw, written = data.draw(source_file(sft_rows(target[3])), label="file")
        run_file(target, data.draw(configs["sft"], label="config"), name, raw, written)

    explore(body, slice_examples=8)


def test_preference_files_through_the_pair_path(target):
    def body(data):
        name, raw, written = data.draw(source_file(pair_rows(target[3])), label="file")
        run_file(target, data.draw(configs["preference"], label="config"), name, raw, written)

    explore(body, slice_examples=6)


def test_unpaired_files_through_the_unpaired_path(target):
    def body(data):
        name, raw, written = data.draw(source_file(unpaired_rows(target[3])), label="file")
        run_file(target, data.draw(configs["unpaired"], label="config"), name, raw, written)

    explore(body, slice_examples=6)


def test_well_formed_hostile_rows_are_masked_by_the_rule(target):
    """Rows that parse (no garbage, plain JSON lines): most are kept, so the oracle check has rows to judge."""
    def body(data):
        convs = [data.draw(conversation(target[3])) for _ in range(data.draw(st.integers(1, 4)))]
        raw = b"".join(json.dumps({"messages": m, **({"tools": t} if t else {})}).encode() + b"\n" for m, t in convs)
        run_file(target, SFT, "rows.jsonl", raw, {len(convs)})

    explore(body, slice_examples=8)


def test_sources_end_to_end(target):
    """Two sources read by ``load_and_process_sources`` (``datasets`` builds and maps them, as a run does):
    every row of each source accounted for under that source's label."""
    from qlora_train.data.dataset import load_and_process_sources

    if not FUZZ_SECONDS and target[0] != "qwen3":
        pytest.skip("the CI slice reads sources end to end on one vocabulary (make fuzz: on each)")

    def body(data):
        files = [data.draw(source_file(sft_rows(target[3])), label=f"file {k}") for k in range(2)]
        with tempfile.TemporaryDirectory() as tmp:
            sources = []
            for k, (name, raw, _) in enumerate(files):
                path = Path(tmp) / f"{k}-{name}"
                path.write_bytes(raw)
                sources.append(DatasetSource(path=str(path)))
            cfg = DataConfig(datasets=sources, cache_dir=str(Path(tmp) / "cache"), batch_size=4)
            try:
                _, processed = load_and_process_sources(sources, cfg, target[1])
            except SourceError as err:  # a file without rows, or a .json array whose frame is broken: named
                assert any(({0, SOURCE_ERROR} & written) and f"{k}-{name}" in str(err)
                           for k, (name, _, written) in enumerate(files)), str(err)
                return
            cols = processed.select_columns(["source", *SFT_ROW.output_columns]).to_dict()
        for k, (name, _, written) in enumerate(files):
            label = f"{k}:{sources[k].path}"
            mine = {col: [v for v, s in zip(values, cols["source"]) if s == label] for col, values in cols.items()}
            check_accounting(mine, written, f"{k}-{name}")

    explore(body, slice_examples=2, chunk=4)


# ---------------------------------------------------------------------------------------------- found by the fuzz
def _one_file(tok, name: str, body: bytes, cfg: DataConfig = SFT) -> dict[str, list]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(body)
        return process_file(path, tok, cfg)


ANSWER = b'{"role": "assistant", "content": "4"}'


def test_dedup_hash_of_a_row_with_a_lone_surrogate_where_the_template_does_not_write_it(qwen3_tok):
    """A lone surrogate (an undecodable byte) in a message name the template never writes: the row renders and is
    kept; its dedup hash once failed to encode it (an unexpected UnicodeEncodeError, counted as our bug)."""
    body = (b'{"messages": [{"role": "user", "content": "2+2?"}, '
            b'{"role": "assistant", "content": "4", "name": "a\xff"}]}\n')
    out = _one_file(qwen3_tok, "rows.jsonl", body, DataConfig(dedup=True))
    check_accounting(out, {1}, "rows.jsonl")
    assert out["drop_reason"] == [""] and out["content_hash"][0]




@pytest.mark.parametrize("line", [b'{"a": ' + b"9" * 5000 + b"}", b"[" * 5000 + b"]" * 5000,
                                  b'{"a": ' + b"9" * 5000 + b', "b": "\xff"}'],
                         ids=["huge-int", "deep", "huge-int-and-undecodable-byte"])
def test_item1_a_json_line_is_counted(qwen3_tok, line):
    out = _one_file(qwen3_tok, "rows.jsonl", line + b"\n" + b'{"messages": [{"role": "user", "content": "hi"}, '
                    + ANSWER + b"]}\n")
    check_accounting(out, {2}, "rows.jsonl")
    assert out["drop_reason"] == ["unparseable_json", ""]


@pytest.mark.parametrize("item", [b"9" * 5000, b"[" * 5000 + b"]" * 5000], ids=["huge-int", "deep"])
def test_item1_a_json_array_file_is_counted(qwen3_tok, item):
    out = _one_file(qwen3_tok, "rows.json", b"[" + item + b"]")
    check_accounting(out, {1}, "rows.json")
    assert out["drop_reason"] == ["unparseable_json"]


@pytest.mark.parametrize("bomb", list(JSON_BOMBS.values()), ids=list(JSON_BOMBS))
def test_item1_json_inside_a_field_is_refused_as_the_rows_fault(qwen3_tok, bomb):
    """Tool-call arguments (and tools) given as JSON text are parsed by the parse stage: an integer of more than
    4,300 digits or nesting 5,000 deep there is the row's fault, not an unexpected exception."""
    call = {"type": "function", "function": {"name": "get", "arguments": bomb}}
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": "x"}, {"role": "assistant", "content": "ok"}]}
    out = _one_file(qwen3_tok, "rows.jsonl", json.dumps(row).encode() + b"\n")
    check_accounting(out, {1}, "rows.jsonl")


ROW = b'{"messages": [{"role": "user", "content": "hi"}, ' + ANSWER + b"]}"


def test_accounting_gap_a_json_array_file_with_a_bom_is_read_as_its_rows(qwen3_tok):
    """A UTF-8 BOM before a ``.json`` array (Windows editors write one): the file is taken for JSON lines, and
    its two rows come out as four (``[``, ``{..},`` and ``]`` unparseable)."""
    out = _one_file(qwen3_tok, "rows.json", b"\xef\xbb\xbf[\n" + ROW + b",\n" + ROW + b"\n]")
    check_accounting(out, {2}, "rows.json")
    assert out["drop_reason"] == ["", ""]


def test_accounting_gap_a_bom_before_the_first_json_line(qwen3_tok):
    """A UTF-8 BOM before the first JSON line makes that row ``unparseable_json``."""
    out = _one_file(qwen3_tok, "rows.jsonl", b"\xef\xbb\xbf" + ROW + b"\n" + ROW + b"\n")
    assert out["drop_reason"] == ["", ""]


def test_accounting_gap_a_carriage_return_inside_a_json_line(qwen3_tok):
    """JSON lines end at ``\\n`` (``\\r\\n`` included); a stray ``\\r`` inside a line (invalid JSON there) is read as
    a line break: one row written, two counted."""
    out = _one_file(qwen3_tok, "rows.jsonl", ROW[:20] + b"\r" + ROW[20:] + b"\n")
    check_accounting(out, {1}, "rows.jsonl")


@pytest.mark.parametrize("line", [b"\xc2\x85", b"\x0c\x1c", b"\xe2\x80\xa8"], ids=["NEL", "FF-FS", "LS"])
def test_accounting_gap_a_line_of_unicode_whitespace_is_counted(qwen3_tok, line):
    """A line holding only characters ``str.strip`` takes for whitespace but JSON does not (NEL, form feed, file
    separator, line separator) is skipped as blank: neither read nor counted."""
    out = _one_file(qwen3_tok, "rows.jsonl", ROW + b"\n" + line + b"\n" + ROW + b"\n")
    check_accounting(out, {3}, "rows.jsonl")
    assert out["drop_reason"] == ["", "unparseable_json", ""]


def test_a_lone_surrogate_in_reasoning_the_template_drops_is_counted_not_a_crash(llama3_vocab_tok):
    """Llama 3's template does not write reasoning: the row is trained without it and the dropped reasoning's
    tokens are counted. A lone surrogate there once escaped ``process_rows`` (UnicodeEncodeError from the
    counter's probe): the whole run stopped on one row."""
    from qlora_train.data import process_rows

    rows = [{"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "ok", "reasoning_content": "r\udcff"}]}]
    out = process_rows(rows, llama3_vocab_tok, DataConfig(reasoning_history="drop"))
    assert out["drop_reason"] == [""]
    assert json.loads(out["parse_report"][0])["reasoning_dropped_tokens"] == 2  # 'r' and the surrogate as '?'


def test_a_pair_with_a_lone_surrogate_checked_by_the_rule_is_invalid_unicode(llama3_vocab_tok):
    """``data.rule_check`` checks a source's first pairs before ``fit_pair``; a side whose render holds a lone
    surrogate once reached the tokenizer there (an unexpected TypeError, counted as our bug)."""
    from qlora_train.data import process_rows

    out = process_rows([{"prompt": "hi", "chosen": "a\udcffb", "rejected": "no"}], llama3_vocab_tok,
                       DataConfig(objective="preference", rule_check="all"))
    assert out["drop_reason"] == ["invalid_unicode"] and not out["error_traceback"][0]


def test_an_expanded_example_with_a_lone_surrogate_is_left_out_not_a_crash(qwen3_tok):
    """qwen3 drops an earlier answer's reasoning; ``reasoning_history: expand`` makes an extra example that
    writes it. With a lone surrogate in that reasoning the extra example cannot be tokenized: it is left out (its
    turn counted under ``reasoning_dropped_turns``) and the row kept, whether ``data.rule_check`` picks the row
    or not (the check once tokenized it: an unexpected TypeError, counted as our bug)."""
    from qlora_train.data import process_rows

    rows = [{"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "a", "reasoning_content": "r\udcff"},
                          {"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}]
    for check in ("off", "all"):
        out = process_rows(rows, qwen3_tok, DataConfig(rule_check=check))
        assert out["drop_reason"] == [""] and not out["error_traceback"][0], check
        assert out["expanded_input_ids"] == [[]]
        assert json.loads(out["parse_report"][0])["reasoning_dropped_turns"] == 1


@pytest.mark.parametrize("body", [b"\n", b"[]"], ids=["blank-jsonl", "empty-array"])
def test_accounting_gap_a_source_without_rows(qwen3_tok, tmp_path, body):
    from qlora_train.data.dataset import load_and_process_sources
    from qlora_train.errors import DataError

    path = tmp_path / ("rows.jsonl" if body == b"\n" else "rows.json")
    path.write_bytes(body)
    sources = [DatasetSource(path=str(path))]
    with pytest.raises(DataError, match="rows.json"):
        load_and_process_sources(sources, DataConfig(datasets=sources, cache_dir=str(tmp_path / "cache")), qwen3_tok)


@pytest.mark.parametrize("objective, body", [
    ("preference", b'{"prompt": [{"role": "user\xff", "content": "hi"}], "chosen": "a", "rejected": "b"}'),
    ("unpaired", b'{"prompt": [{"role": "user\xff", "content": "hi"}], "completion": "a", "label": true}'),
], ids=["preference", "unpaired"])
def test_a_prompt_role_with_a_lone_surrogate_refuses_its_row_not_the_run(qwen3_tok, objective, body):
    """A raw ``\\xff`` in a pair's or a KTO row's prompt role (read as ``\\udcff``): the refusal's detail quotes the
    role, and writing it to the Arrow table once killed the run (UnicodeEncodeError). Refused and counted, the
    surrogate stored as its escape; the next row kept."""
    ok = (b'{"prompt": "hi", "chosen": "a", "rejected": "b"}' if objective == "preference" else
          b'{"prompt": "hi", "completion": "a", "label": true}')
    out = _one_file(qwen3_tok, "rows.jsonl", body + b"\n" + ok + b"\n", DataConfig(objective=objective))
    check_accounting(out, {2}, "rows.jsonl")
    assert out["drop_reason"] == ["pair_bad_prompt", ""]
    assert out["drop_detail"][0].endswith("rows.jsonl:1: the prompt ends with a user\\udcff message: it must end "
                                          "with a user turn (or a tool result) for a response to answer")


def test_a_domain_with_a_lone_surrogate_is_stored_as_its_escape(qwen3_tok):
    body = b'{"messages": [{"role": "user", "content": "hi"}, ' + ANSWER + b'], "topic": "ma\xffth"}\n'
    out = _one_file(qwen3_tok, "rows.jsonl", body, DataConfig(domain_key="topic"))
    assert out["drop_reason"] == [""] and out["domain"] == ["ma\\udcffth"]
