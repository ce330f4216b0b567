"""Every row format, from a small file written here, through the whole build (real Qwen3 tokenizer)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from qlora_train.config import DataConfig, DatasetSource
from qlora_train.data import canonicalize_row, process_rows
from qlora_train.data.dataset import build_datasets
from qlora_train.data.formats import pretokenized_ids_and_mask, segments_text_and_mask
from qlora_train.masking import IGNORE_INDEX, token_example

EMPTY_THINK = "<think>\n\n</think>\n\n"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def build(tmp_path, tok, rows, source_options=None, **options):
    """rows -> a JSON lines file -> build_datasets -> [(full text, trained text)] and the report."""
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = DataConfig(datasets=[DatasetSource(path=path, **(source_options or {}))], **options)
    train, _, report = build_datasets(cfg, tok)
    out = [(tok.decode(r["input_ids"]), tok.decode([i for i, lab in zip(r["input_ids"], r["labels"])
                                                      if lab != IGNORE_INDEX])) for r in train]
    return out, report


def chat(*turns):
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)


def test_messages_with_field_property_and_role_mappings(tmp_path, qwen3_tok):
    row = {"dialog": [{"speaker": "narrator", "text": "Be brief."}, {"speaker": "human", "text": "hi"},
                      {"speaker": "bot", "text": "yo"}]}
    options = {"messages_field": "dialog", "message_property_mappings": {"role": "speaker", "content": "text"},
               "roles": {"system": ["narrator"], "user": ["human"], "assistant": ["bot", "model"]}}
    [(text, trained)], report = build(tmp_path, qwen3_tok, [row], source_options=options)
    assert text == chat(("system", "Be brief."), ("user", "hi"), ("assistant", EMPTY_THINK + "yo"))
    assert trained == EMPTY_THINK + "yo<|im_end|>"
    assert report.parse["schemas"] == {"messages": 1} and report.parse["unknown_roles"] == {}


def test_sharegpt_preset(tmp_path, qwen3_tok):
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    [(text, trained)], report = build(tmp_path, qwen3_tok, [row], source_options={"schema": "sharegpt"})
    assert text == chat(("user", "hi"), ("assistant", EMPTY_THINK + "yo"))
    assert trained == EMPTY_THINK + "yo<|im_end|>" and report.parse["schemas"] == {"sharegpt": 1}


def test_prompt_response_with_field_mappings(tmp_path, qwen3_tok):
    rows = [{"q": "2+2?", "a": "4"}]
    [(text, trained)], _ = build(tmp_path, qwen3_tok, rows, dataset_schema="prompt_response",
                                 field_mappings={"prompt": "q", "response": "a"})
    assert text == chat(("user", "2+2?"), ("assistant", EMPTY_THINK + "4"))
    assert trained == EMPTY_THINK + "4<|im_end|>"


def test_alpaca_default_format_and_single_dialogue_with_system(tmp_path, qwen3_tok):
    rows = [{"instruction": "Translate.", "input": "hola", "output": "hello"},
            {"system": "Be brief.", "instruction": "Say hi.", "input": "", "output": "hi"}]
    [(t1, tr1), (t2, tr2)], report = build(tmp_path, qwen3_tok, rows)
    assert t1 == chat(("user", "Translate.\n\nhola"), ("assistant", EMPTY_THINK + "hello"))
    assert t2 == chat(("system", "Be brief."), ("user", "Say hi."), ("assistant", EMPTY_THINK + "hi"))
    assert (tr1, tr2) == (EMPTY_THINK + "hello<|im_end|>", EMPTY_THINK + "hi<|im_end|>")
    assert report.parse["schemas"] == {"alpaca": 2}


def test_custom_instruct_format(tmp_path, qwen3_tok):
    rows = [{"instruction": "Translate.", "input": "hola", "output": "hello"},
            {"instruction": "Say hi.", "output": "hi"}]
    options = {"format": "### Task\n{instruction}\n### Input\n{input}", "no_input_format": "### Task\n{instruction}"}
    [(t1, _), (t2, _)], _ = build(tmp_path, qwen3_tok, rows, source_options={"schema": "alpaca", **options})
    assert t1 == chat(("user", "### Task\nTranslate.\n### Input\nhola"), ("assistant", EMPTY_THINK + "hello"))
    assert t2 == chat(("user", "### Task\nSay hi."), ("assistant", EMPTY_THINK + "hi"))


def test_bare_list_rows_with_a_custom_role(tmp_path, qwen3_tok):
    row = [{"role": "knowledge", "content": "Paris is in France."}, {"role": "user", "content": "Where is Paris?"},
           {"role": "assistant", "content": "France."}]
    [(text, trained)], report = build(tmp_path, qwen3_tok, [row], roles={"system": ["knowledge"]})
    assert text == chat(("system", "Paris is in France."), ("user", "Where is Paris?"),
                        ("assistant", EMPTY_THINK + "France."))
    assert trained == EMPTY_THINK + "France.<|im_end|>" and report.parse["unknown_roles"] == {}
    # without the mapping the role is kept (and counted), and Qwen3 renders it under its own name
    assert canonicalize_row(row).report.unknown_roles == {"knowledge": 1}


def test_segments(tmp_path, qwen3_tok):
    row = {"segments": [{"text": "Q: 2+2\n", "label": False}, {"text": "A: 4", "label": True},
                        {"text": "\n(checked)", "label": False}]}
    [(text, trained)], report = build(tmp_path, qwen3_tok, [row])
    assert text == "Q: 2+2\nA: 4\n(checked)"  # no chat template, no special token added
    assert trained == "A: 4"
    assert report.parse["schemas"] == {"segments": 1}


def test_pretokenized_used_as_given_and_validated(tmp_path, qwen3_tok):
    ids = qwen3_tok.encode("Hello world, again")
    rows = [{"input_ids": ids, "labels": [IGNORE_INDEX] * 2 + ids[2:]},
            {"input_ids": ids},  # no labels: all trained
            {"input_ids": ids + [0, 0], "attention_mask": [1] * len(ids) + [0, 0]},  # padding cut
            {"input_ids": ids, "labels": ids[:-1]},
            {"input_ids": [len(qwen3_tok) + 5]},
            {"input_ids": ids, "labels": [7] * len(ids)},
            {"input_ids": ids, "attention_mask": [0] + [1] * (len(ids) - 1)}]
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    train, _, report = build_datasets(DataConfig(datasets=[DatasetSource(path=path)]), qwen3_tok)
    assert train["input_ids"] == [ids, ids, ids]
    assert train["labels"] == [[IGNORE_INDEX] * 2 + ids[2:], ids, ids]
    assert report.dropped == {"bad_pretokenized": 4} and report.parse["schemas"] == {"pretokenized": 7}
    assert report.first_dropped["bad_pretokenized"] == f"{path}:4: labels has {len(ids) - 1} entries for {len(ids)} ids"


def test_plain_text_gets_eos_and_is_cut_into_blocks(tmp_path, qwen3_tok):
    long = " ".join(f"w{i}" for i in range(30))
    rows = [{"text": "short one"}, {"text": long}, {"text": "x"}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = DataConfig(datasets=[DatasetSource(path=path, schema="completion")], max_length=16, min_chars=2)
    train, _, report = build_datasets(cfg, qwen3_tok)
    eos = qwen3_tok.eos_token
    n_long = len(qwen3_tok.encode(long + eos))
    assert n_long > 32 and report.text_blocks_added == (n_long + 15) // 16 - 1
    assert qwen3_tok.decode(train[0]["input_ids"]) == "short one" + eos
    blocks = [r["input_ids"] for r in train][1:]
    assert all(len(b) == 16 for b in blocks[:-1]) and qwen3_tok.decode(sum(blocks, [])) == long + eos
    assert all(r["labels"] == r["input_ids"] for r in train)  # every token trained
    assert report.dropped == {"filtered_by_length": 1}
    assert report.first_dropped["filtered_by_length"] == f"{path}:3: 1 characters, outside [2, inf]"


@pytest.mark.parametrize("schema, row", [
    ("segments", {"segments": [{"text": "a", "label": "yes"}]}),
    ("segments", {"segments": "a"}),
    ("text", {"body": "a"}),
])
def test_template_free_rows_name_the_problem(tmp_path, qwen3_tok, schema, row):
    path = write_jsonl(tmp_path / "bad.jsonl", [row, {"segments": [{"text": "ok", "label": True}], "text": "ok"}])
    cfg = DataConfig(datasets=[DatasetSource(path=path, schema=schema)])
    _, _, report = build_datasets(cfg, qwen3_tok)
    assert report.rows_kept == 1 and report.dropped == {"bad_row": 1}
    assert report.first_dropped["bad_row"].startswith(f"{path}:1: {schema}")


KEY = st.text(alphabet="abcdefghijklmnop_", min_size=1, max_size=6)
TEXT = st.text(alphabet="abc xyz", min_size=1, max_size=10).filter(str.strip)


@settings(max_examples=100, deadline=None)
@example(role_key="a", content_key="name", user_names=["a"], bot_names=["b"], turns=[("a", "a", 0)])  # found in CI
@given(role_key=KEY, content_key=KEY, user_names=st.lists(KEY, min_size=1, max_size=3, unique=True),
       bot_names=st.lists(KEY, min_size=1, max_size=3, unique=True),
       turns=st.lists(st.tuples(TEXT, TEXT, st.integers(0, 10)), min_size=1, max_size=3))
def test_mapped_rows_equal_their_plain_form(role_key, content_key, user_names, bot_names, turns):
    """Renamed keys and role names + the mappings canonicalize exactly like the plain OpenAI form."""
    assume(role_key != content_key and not set(user_names) & set(bot_names))
    plain, mapped = [], []
    for q, a, pick in turns:
        plain += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        mapped += [{role_key: user_names[pick % len(user_names)], content_key: q},
                   {role_key: bot_names[pick % len(bot_names)], content_key: a}]
    cfg = DataConfig(messages_field="turns", message_property_mappings={"role": role_key, "content": content_key},
                     roles={"user": user_names, "assistant": bot_names})
    assert canonicalize_row({"turns": mapped}, cfg).messages == canonicalize_row({"messages": plain}).messages


@settings(max_examples=100, deadline=None)
@given(segments=st.lists(st.tuples(st.text(max_size=6), st.booleans()), min_size=1, max_size=6))
def test_segments_mask_is_the_labels_char_by_char(segments):
    text, mask = segments_text_and_mask({"segments": [{"text": t, "label": lab} for t, lab in segments]})
    assert text == "".join(t for t, _ in segments)
    assert mask.tolist() == [int(lab) for t, lab in segments for _ in t]


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 99), st.booleans()), min_size=1, max_size=12))
def test_pretokenized_labels_round_trip(pairs):
    ids = [i for i, _ in pairs]
    labels = [i if keep else IGNORE_INDEX for i, keep in pairs]
    got_ids, mask = pretokenized_ids_and_mask({"input_ids": ids, "labels": labels}, vocab_size=100)
    assert got_ids == ids and mask.tolist() == [int(k) for _, k in pairs]
    example = token_example(got_ids, mask).example()
    assert example["labels"] == labels and example["input_ids"] == ids


ANY = st.recursive(st.none() | st.booleans() | st.integers(-200, 200) | st.text(max_size=8),
                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
                       ["role", "content", "from", "value", "text", "label", "training", "weight"]), inner, max_size=3),
                   max_leaves=10)
ROW_KEYS = ["messages", "conversations", "segments", "input_ids", "labels", "attention_mask", "instruction",
            "input", "output", "prompt", "response", "text", "system"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.dictionaries(st.sampled_from(ROW_KEYS), ANY, max_size=4) | st.lists(ANY, max_size=3),
                     min_size=1, max_size=4),
       schema=st.sampled_from(["auto", "messages", "alpaca", "segments", "pretokenized", "text"]))
def test_any_row_is_kept_or_dropped_with_a_reason(qwen3_tok, rows, schema):
    """Whatever the row and schema: no exception, one output per row, kept rows have aligned, trained labels."""
    out = process_rows(rows, qwen3_tok, DataConfig(dataset_schema=schema, max_length=64))
    assert len(out["drop_reason"]) == len(rows)
    for reason, detail, ids, labels in zip(out["drop_reason"], out["drop_detail"], out["input_ids"], out["labels"]):
        if reason:
            assert detail.startswith("row ") and ids == labels == []
        else:
            assert len(ids) == len(labels) > 0 and any(lab != IGNORE_INDEX for lab in labels)
