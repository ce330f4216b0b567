"""Preference rows through the dataset pipeline (``data.objective: preference``): every format through
``build_datasets`` with exact counts and columns, bad rows counted with their location, pair truncation (system +
last exchange + both whole responses), the score-margin filter, dedup / eval split / mixing, the config checks,
``--stats-only`` / ``--debug-samples`` / ``--preprocess`` through the CLI; real Qwen vocabulary, qwen3 template."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlora_train.cli import main
from qlora_train.config import ConfigError, DataConfig, DatasetSource, MixingConfig, load_config
from qlora_train.data.dataset import build_datasets
from qlora_train.data.drops import DropReason
from qlora_train.data.pairs import build_preference_example, canonicalize_pair, fit_pair, side_lengths
from qlora_train.data.pipeline import process_rows
from qlora_train.data.processed import PAIR_ROW
from qlora_train.masking import RowRejected
from qlora_train.masking.tokenize import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[2]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}]}
RESULT = {"role": "tool", "content": "{\"temp_c\": 19}"}
GOOD = [  # lines 1-6: one pair of each format, some with scores, reasoning, a tool call
    {"prompt": "Name the largest planet.", "chosen": "Jupiter.", "rejected": "Mars.",
     "score_chosen": 9, "score_rejected": 2},
    {"prompt": "What is 12 divided by 4?", "chosen": "<think>12 / 4 = 3</think>3.", "rejected": "4.",
     "score_chosen": 5, "score_rejected": 4.5},
    {"tools": [WEATHER], "prompt": [{"role": "system", "content": "Use tools for live data."},
                                    {"role": "user", "content": "How warm is it in Lima?"}],
     "chosen": [CALL, RESULT, {"role": "assistant", "content": "19 degrees in Lima."}],
     "rejected": [{"role": "assistant", "content": "Probably cold."}]},
    {"instruction": "Reverse the word.", "input": "stop", "chosen": "pots", "rejected": "spot"},
    {"chosen": [{"role": "user", "content": "Opposite of up?"}, {"role": "assistant", "content": "Down."}],
     "rejected": [{"role": "user", "content": "Opposite of up?"}, {"role": "assistant", "content": "Left."}]},
    {"chosen": "\n\nHuman: Is ice cold?\n\nAssistant: Yes, it is frozen water.",
     "rejected": "\n\nHuman: Is ice cold?\n\nAssistant: No, ice is hot."},
]
BAD = [  # lines 7-12: each refused for one reason
    (json.dumps({"prompt": "Say hi.", "chosen": "Hi!"}), DropReason.PAIR_MISSING_SIDE),
    (json.dumps({"prompt": "Say hi.", "completion": "Hi!", "label": True}), DropReason.UNPAIRED_PREFERENCE),
    ("{not json", DropReason.UNPARSEABLE_JSON),
    (json.dumps({"prompt": "Say hi.", "chosen": "Hello.", "rejected": "Hello."}), DropReason.PAIR_IDENTICAL),
    (json.dumps({"prompt": "Weather?", "chosen": [CALL, RESULT], "rejected": "Sunny."}), DropReason.PAIR_BAD_RESPONSE),
    (json.dumps(GOOD[0]), DropReason.DUPLICATE),
]


def write_rows(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def pairs_file(tmp_path) -> Path:
    return write_rows(tmp_path / "pairs.jsonl", [json.dumps(r) for r in GOOD] + [line for line, _ in BAD])


def data_config(tmp_path, paths, **kw) -> DataConfig:
    return DataConfig(datasets=[DatasetSource(path=str(p)) for p in paths], objective="preference",
                      cache_dir=str(tmp_path / "hf-cache"), **{"max_length": 256, "dedup": True, **kw})


def assert_pair(row: dict, max_length: int) -> None:
    """Both sides within max_length, labels aligned, the shared prompt identical and never trained."""
    n = row["prompt_length"]
    assert n > 0 and row["chosen_input_ids"][:n] == row["rejected_input_ids"][:n]
    for side in ("chosen", "rejected"):
        ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
        assert len(ids) == len(labels) <= max_length
        assert set(labels[:n]) == {IGNORE_INDEX} and any(t != IGNORE_INDEX for t in labels[n:])


def test_pairs_of_every_format_through_build_datasets_counted_exactly(tmp_path, pairs_file, qwen3_tok):
    train, eval_ds, report = build_datasets(data_config(tmp_path, [pairs_file]), qwen3_tok)
    assert eval_ds is None and report.objective == "preference"
    assert (report.rows_in, report.rows_kept, report.train_rows) == (12, 6, 6)
    assert report.dropped == {reason: 1 for _, reason in BAD}
    for k, (_, reason) in enumerate(BAD, start=len(GOOD) + 1):  # each named with its file and line
        assert report.first_dropped[reason].startswith(f"{pairs_file}:{k}: ")
    assert "same content as" in report.first_dropped[DropReason.DUPLICATE]
    assert train.column_names == list(PAIR_ROW.model_columns) == [
        "chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "prompt_length", "images"]
    rows = train.to_list()
    for row in rows:
        assert_pair(row, 256)
    # each row is exactly build_preference_example of its canonical pair
    for raw, row in zip(GOOD, rows):
        pair = canonicalize_pair(raw)
        ex = build_preference_example(pair.prompt, pair.chosen, pair.rejected, qwen3_tok, tools=pair.tools)
        assert {k: ex[k] for k in PAIR_ROW.model_columns} == row
    # the tool-call pair: the call, the answer and their end markers trained; the tool result not
    trained = qwen3_tok.decode([t for t in rows[2]["chosen_labels"] if t != IGNORE_INDEX])
    assert '"city": "Lima"' in trained and "19 degrees in Lima." in trained and "temp_c" not in trained
    both = [sum(len(r[f"{s}_input_ids"]) for s in ("chosen", "rejected")) for r in rows]
    assert report.tokens == sum(both) + both[0]  # the duplicate of line 1 was processed before it was marked
    assert "(both sides of each pair)" in "\n".join(report.lines())


def test_bad_pairs_are_refused_in_process_rows_with_location_never_raised(qwen3_tok):
    rows = [json.loads(line) for line, _ in BAD if line.startswith("{\"")][:5] + [7, ["not", "a pair"]]
    out = process_rows(rows, qwen3_tok, DataConfig(objective="preference"), locations=[f"f:{i}" for i in
                                                                                          range(len(rows))])
    assert out["drop_reason"] == [DropReason.PAIR_MISSING_SIDE, DropReason.UNPAIRED_PREFERENCE,
                                  DropReason.PAIR_IDENTICAL, DropReason.PAIR_BAD_RESPONSE, "",
                                  DropReason.BAD_ROW, DropReason.BAD_ROW]
    assert all(d.startswith(f"f:{i}: ") for i, d in enumerate(out["drop_detail"]) if d)
    assert out["chosen_input_ids"][4] and not out["chosen_input_ids"][0] and "input_ids" not in out  # a PAIR_ROW


def long_prompt_pair(exchanges: int = 4) -> dict:
    prompt = [{"role": "system", "content": "You are terse."}]
    for k in range(exchanges):
        prompt += [{"role": "user", "content": f"Old question {k}: " + "tell me about rivers " * 6},
                   {"role": "assistant", "content": f"Old answer {k}: " + "rivers flow to the sea " * 6}]
    prompt.append({"role": "user", "content": "Last question: which river is longest?"})
    return {"prompt": prompt, "chosen": "The Nile, by most measures, or the Amazon by others.",
            "rejected": "The Thames."}


def test_truncation_keeps_system_last_exchange_and_both_whole_responses(qwen3_tok):
    pair = canonicalize_pair(long_prompt_pair())
    full = fit_pair(pair, qwen3_tok, max_length=10_000)
    assert full.dropped_turns == 0
    # room for the system, the last question and the two newest exchanges, not more
    last_two = canonicalize_pair({**long_prompt_pair(), "prompt": pair.prompt[:1] + pair.prompt[5:]})
    fits = fit_pair(last_two, qwen3_tok, max_length=10_000).example
    max_length = max(len(fits["chosen_input_ids"]), len(fits["rejected_input_ids"]))
    fitted = fit_pair(pair, qwen3_tok, max_length=max_length)
    assert fitted.dropped_turns == 2 and fitted.example == fits
    assert fitted.tokens_before == len(full.example["chosen_input_ids"]) + len(full.example["rejected_input_ids"])
    text = qwen3_tok.decode(fitted.example["chosen_input_ids"])
    assert "You are terse." in text and "which river is longest?" in text and "Old question 3" in text
    assert "Old question 1" not in text
    for side, answer in (("chosen", "The Nile, by most measures, or the Amazon by others."),
                         ("rejected", "The Thames.")):
        assert answer in qwen3_tok.decode([t for t in fitted.example[f"{side}_labels"] if t != IGNORE_INDEX])
    assert_pair(fitted.example, max_length)
    # a response that cannot fit whatever the prompt loses: refused, never cut
    with pytest.raises(RowRejected) as err:
        fit_pair(pair, qwen3_tok, max_length=30)
    assert err.value.reason == DropReason.TOO_LONG and err.value.detail.startswith("chosen: ")
    assert "4 of 4 middle prompt exchanges dropped" in err.value.detail
    with pytest.raises(RowRejected, match="data.on_too_long: drop"):
        fit_pair(pair, qwen3_tok, max_length=max_length, on_too_long="drop")


def trained(tok, labels: list[int]) -> str:
    return tok.decode([t for t in labels if t != IGNORE_INDEX])


REASONED = {"prompt": "What is 6 times 7?", "rejected": "41.",
            "chosen": [{"role": "assistant", "content": "42.",
                        "reasoning_content": " ".join(f"step {k}: six sevens, counting on." for k in range(40))}]}


def test_a_response_over_max_length_has_its_reasoning_trimmed_from_its_end_never_its_answer(qwen3_tok):
    pair = canonicalize_pair(REASONED)
    full = fit_pair(pair, qwen3_tok, max_length=10_000).example
    max_length = len(full["chosen_input_ids"]) - 100
    fitted = fit_pair(pair, qwen3_tok, max_length=max_length)
    ex = fitted.example
    assert (fitted.dropped_turns, fitted.cut_sides) == (0, ())
    assert 100 <= fitted.reasoning_trimmed_tokens <= 100 + 3  # the excess, and the slack of BPE merges at the cut
    assert max_length - 3 <= len(ex["chosen_input_ids"]) <= max_length
    # the rejected side and the prompt are untouched; the chosen side keeps the start of its reasoning and its
    # whole answer with its end-of-turn, all trained
    assert ex["prompt_length"] == full["prompt_length"]
    assert (ex["rejected_input_ids"], ex["rejected_labels"]) == (full["rejected_input_ids"], full["rejected_labels"])
    chosen = trained(qwen3_tok, ex["chosen_labels"])
    assert chosen.startswith("<think>\nstep 0: six sevens") and chosen.endswith("</think>\n\n42.<|im_end|>")
    assert "step 39" not in chosen and "step 30" in chosen
    assert_pair(ex, max_length)


def test_max_response_length_cuts_a_response_at_the_token_level_and_says_so(qwen3_tok):
    row = {"prompt": "List colours.", "chosen": "red, green, blue, yellow, purple, orange, pink, brown, grey.",
           "rejected": "red."}
    pair = canonicalize_pair(row)
    full = fit_pair(pair, qwen3_tok, max_length=10_000).example
    n = full["prompt_length"]
    assert len(full["chosen_input_ids"]) - n > 10 >= len(full["rejected_input_ids"]) - n
    fitted = fit_pair(pair, qwen3_tok, max_length=10_000, max_response_length=10)
    ex = fitted.example
    assert fitted.cut_sides == ("chosen",) and fitted.reasoning_trimmed_tokens == 0
    # exactly the uncut side's first tokens: its prompt, then 10 response tokens (the end-of-turn cut away)
    assert ex["chosen_input_ids"] == full["chosen_input_ids"][:n + 10]
    assert ex["chosen_labels"] == full["chosen_labels"][:n + 10]
    assert "<|im_end|>" not in trained(qwen3_tok, ex["chosen_labels"])
    assert (ex["rejected_input_ids"], ex["rejected_labels"]) == (full["rejected_input_ids"], full["rejected_labels"])
    # max_length also cuts, once max_response_length allows cutting at all; unset, the pair is refused
    # (Qwen3's empty think block, 4 tokens, then "red" and "," or ".": the sides differ in their 6th token)
    fitted = fit_pair(pair, qwen3_tok, max_length=n + 6, max_response_length=1000)
    assert fitted.cut_sides == ("chosen", "rejected") and side_lengths(fitted.example) == {"chosen": n + 6,
                                                                                          "rejected": n + 6}
    with pytest.raises(RowRejected, match="data.max_response_length would cut the response"):
        fit_pair(pair, qwen3_tok, max_length=n + 6)
    # a cut that leaves nothing to compare: the same ids on both sides, or nothing trained
    with pytest.raises(RowRejected) as err:
        fit_pair(canonicalize_pair({**row, "rejected": "red, green, blue."}), qwen3_tok, max_length=10_000,
                 max_response_length=2)
    assert err.value.reason == DropReason.PAIR_IDENTICAL and "once cut" in err.value.detail
    with pytest.raises(RowRejected, match="nothing of the response is trained within"):
        fit_pair(pair, qwen3_tok, max_length=n, max_response_length=1000)


def test_max_prompt_length_drops_the_prompts_middle_exchanges_then_refuses(qwen3_tok):
    pair = canonicalize_pair(long_prompt_pair())
    last_two = canonicalize_pair({**long_prompt_pair(), "prompt": pair.prompt[:1] + pair.prompt[5:]})
    fits = fit_pair(last_two, qwen3_tok, max_length=10_000).example
    fitted = fit_pair(pair, qwen3_tok, max_length=10_000, max_prompt_length=fits["prompt_length"])
    assert (fitted.dropped_turns, fitted.example) == (2, fits)
    last = canonicalize_pair({**long_prompt_pair(), "prompt": pair.prompt[:1] + pair.prompt[-1:]})
    shortest = fit_pair(last, qwen3_tok, max_length=10_000).example["prompt_length"]
    with pytest.raises(RowRejected) as err:
        fit_pair(pair, qwen3_tok, max_length=10_000, max_prompt_length=shortest - 1)
    assert err.value.reason == DropReason.TOO_LONG
    assert err.value.detail.startswith(f"prompt: {shortest} tokens > max_prompt_length={shortest - 1} with 4 of 4")


def test_reasoning_the_prompt_renders_is_trimmed_once_for_both_sides(qwen3_tok):
    # Qwen3 renders reasoning after the last user message: here the prompt's own tool-calling turn
    thought = " ".join(f"I should look up the weather, idea {k}." for k in range(30))
    row = {"tools": [WEATHER], "prompt": [{"role": "user", "content": "How warm is it in Lima?"},
                                          {**CALL, "reasoning_content": thought}, RESULT],
           "chosen": "19 degrees in Lima.", "rejected": "Cold."}
    pair = canonicalize_pair(row)
    full = fit_pair(pair, qwen3_tok, max_length=10_000).example
    assert thought in qwen3_tok.decode(full["chosen_input_ids"][:full["prompt_length"]])
    fitted = fit_pair(pair, qwen3_tok, max_length=10_000, max_prompt_length=full["prompt_length"] - 50)
    ex = fitted.example
    assert fitted.dropped_turns == 0 and 50 <= fitted.reasoning_trimmed_tokens <= 53
    assert ex["prompt_length"] <= full["prompt_length"] - 50
    prompt = qwen3_tok.decode(ex["chosen_input_ids"][:ex["prompt_length"]])
    assert "idea 0." in prompt and "idea 29." not in prompt and '"city": "Lima"' in prompt
    for side, answer in (("chosen", "19 degrees in Lima.<|im_end|>"), ("rejected", "Cold.<|im_end|>")):
        assert trained(qwen3_tok, ex[f"{side}_labels"]).endswith(answer)
    assert_pair(ex, 10_000)


WORDS = st.lists(st.sampled_from(["river", "stone", "blue", "seven", "quietly", "é", "数", "\n"]), min_size=1,
                 max_size=40).map(" ".join)


@st.composite
def long_pairs(draw):
    prompt = [{"role": "system", "content": draw(WORDS)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(0, 3))):
        prompt += [{"role": "user", "content": draw(WORDS)}, {"role": "assistant", "content": draw(WORDS)}]
    prompt.append({"role": "user", "content": draw(WORDS)})

    def response(opening: str):
        m = {"role": "assistant", "content": opening + draw(WORDS)}
        if draw(st.booleans()):
            m["reasoning_content"] = " ".join(draw(WORDS) for _ in range(draw(st.integers(1, 6))))
        return [m]
    share = st.floats(0.3, 1.2)  # of the untruncated pair's longer side, prompt, longer response
    limits = {"max_length": draw(share), "max_prompt_length": draw(st.none() | share),
              "max_response_length": draw(st.none() | share)}
    return canonicalize_pair({"prompt": prompt, "chosen": response("good "), "rejected": response("bad ")}), limits


def test_property_fitted_pairs_keep_every_limit_and_their_shared_prompt(qwen3_tok):
    """Whatever the limits: a fitted pair keeps every one, shares its prompt, keeps its system message and last
    question, trains each uncut side to its end-of-turn, and is cut only with max_response_length; otherwise it
    is refused as too_long (or pair_identical once cut). A pair within its limits is left as it was."""
    outcomes = collections.Counter()

    @settings(max_examples=120, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=long_pairs())
    def run(case):
        outcomes.update(fitted_pair_properties(qwen3_tok, *case))
    run()
    assert {"as_is", "dropped", "trimmed", "cut", DropReason.TOO_LONG} <= set(outcomes), outcomes


def fitted_pair_properties(tok, pair, shares) -> list[str]:
    full = build_preference_example(pair.prompt, pair.chosen, pair.rejected, tok)
    n, longer = full["prompt_length"], max(side_lengths(full).values())
    of = {"max_length": longer, "max_prompt_length": n, "max_response_length": longer - n}
    limits = {key: share and max(1, int(share * of[key])) for key, share in shares.items()}
    try:
        fitted = fit_pair(pair, tok, **limits)
    except RowRejected as rej:
        assert rej.reason == DropReason.TOO_LONG or (rej.reason == DropReason.PAIR_IDENTICAL
                                                     and limits["max_response_length"]), rej
        return [rej.reason]
    ex, n = fitted.example, fitted.example["prompt_length"]
    assert_pair(ex, limits["max_length"])
    assert n <= (limits["max_prompt_length"] or n)
    for side in ("chosen", "rejected"):
        assert len(ex[f"{side}_input_ids"]) - n <= (limits["max_response_length"] or 10**9)
        text = trained(tok, ex[f"{side}_labels"])
        assert text.endswith("<|im_end|>") == (side not in fitted.cut_sides)
    assert not fitted.cut_sides or limits["max_response_length"]
    prompt_text = tok.decode(ex["chosen_input_ids"][:n])
    assert pair.prompt[-1]["content"] in prompt_text
    assert pair.prompt[0]["role"] != "system" or pair.prompt[0]["content"] in prompt_text
    done = [name for name, did in (("dropped", fitted.dropped_turns), ("trimmed", fitted.reasoning_trimmed_tokens),
                                   ("cut", fitted.cut_sides)) if did]
    if not done:
        assert ex == full
    return done or ["as_is"]


def test_truncated_and_too_long_pairs_are_counted_in_the_report(tmp_path, qwen3_tok):
    path = write_rows(tmp_path / "long.jsonl", [json.dumps(long_prompt_pair()), json.dumps(GOOD[0]),
                                               json.dumps({**long_prompt_pair(), "chosen": "word " * 300})])
    train, _, report = build_datasets(data_config(tmp_path, [path], max_length=120), qwen3_tok)
    assert (report.rows_kept, report.rows_turns_dropped, report.dropped) == (2, 1, {DropReason.TOO_LONG: 1})
    assert report.first_dropped[DropReason.TOO_LONG].startswith(f"{path}:3: chosen: ")
    for row in train.to_list():
        assert_pair(row, 120)
    # with data.max_response_length the long response is cut, and a long reasoning trimmed: each counted
    path = write_rows(tmp_path / "cut.jsonl", [json.dumps(long_prompt_pair()), json.dumps(REASONED),
                                              json.dumps({**long_prompt_pair(), "chosen": "word " * 300})])
    _, _, report = build_datasets(data_config(tmp_path, [path], max_length=120, max_response_length=60), qwen3_tok)
    assert (report.rows_kept, report.dropped, report.rows_turns_dropped) == (3, {}, 2)
    assert (report.rows_reasoning_trimmed, report.rows_token_fallback) == (1, {"chosen": 1})  # reasoning first
    assert ("truncation: middle prompt exchanges dropped in 2 pairs, reasoning trimmed in 1, responses cut "
            "(data.max_response_length) in 1") in report.lines()


def test_score_margin_filter_drops_and_counts_its_own_reason(tmp_path, pairs_file, qwen3_tok):
    _, _, report = build_datasets(data_config(tmp_path, [pairs_file], min_score_margin=1.0), qwen3_tok)
    # line 1 (9 - 2) is kept; line 2 (5 - 4.5) and the four pairs without scores are below the margin
    assert report.rows_kept == 1 and report.dropped[DropReason.BELOW_SCORE_MARGIN] == 5
    assert report.first_dropped[DropReason.BELOW_SCORE_MARGIN] == (
        f"{pairs_file}:2: score_chosen - score_rejected = 0.5 < data.min_score_margin=1")
    assert report.dropped[DropReason.DUPLICATE] == 1  # line 12, a copy of line 1, passes the margin


def test_eval_split_and_weighted_mixing_of_pair_sources(tmp_path, pairs_file, qwen3_tok):
    other = write_rows(tmp_path / "other.jsonl", [json.dumps({"prompt": f"Count to {k}.", "chosen": " ".join(
        map(str, range(1, k + 1))), "rejected": "No."}) for k in range(2, 6)])
    cfg = data_config(tmp_path, [pairs_file, other], eval_fraction=0.2)
    train, eval_ds, report = build_datasets(cfg, qwen3_tok)
    assert report.rows_kept == 10 and len(train) + len(eval_ds) == 10 and len(eval_ds) == 2
    assert train.column_names == eval_ds.column_names == list(PAIR_ROW.model_columns)
    cfg = data_config(tmp_path, [pairs_file, other], mixing=MixingConfig(
        stopping_strategy="all_exhausted_without_replacement"))
    cfg.datasets[0].weight, cfg.datasets[1].weight = 3.0, 1.0
    train, _, report = build_datasets(cfg, qwen3_tok)
    assert len(train) == 10 and set(report.mixing_weights.values()) == {0.75, 0.25}
    assert sorted(report.rows_per_source_after_mixing.values()) == [4, 6]


def write_config(tmp_path: Path, model: Path, data_path: Path, **data) -> Path:
    cfg = {"model": {"name_or_path": str(model), "chat_template": "qwen3"},
           "data": {"datasets": [{"path": str(data_path)}], "objective": "preference", "max_length": 256,
                    "cache_dir": str(tmp_path / "hf-cache"), **data},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_preference_config_refuses_packing_and_a_margin_without_pairs(tmp_path, qwen_tokenizer_dir, pairs_file):
    path = write_config(tmp_path, qwen_tokenizer_dir, pairs_file)
    with pytest.raises(ConfigError) as err:
        load_config(path, ["train.packing=true"])
    assert "train.packing: preference pairs are batched as two whole padded rows each" in str(err.value)
    assert "set train.packing: false for data.objective: preference" in str(err.value)
    with pytest.raises(ConfigError, match="data.min_score_margin: applies to preference pairs"):
        load_config(path, ["data.objective=sft", "data.min_score_margin=1"])
    # the pair-only keys where train.method decides the objective: accepted for dpo, refused for sft
    undecided = yaml.safe_load(path.read_text())
    del undecided["data"]["objective"]
    (tmp_path / "undecided.yaml").write_text(yaml.safe_dump(undecided))
    cfg = load_config(tmp_path / "undecided.yaml", ["train.method=dpo", "data.max_response_length=64",
                                                    "data.min_score_margin=1"])
    assert (cfg.data.objective, cfg.data.max_response_length) == ("preference", 64)
    with pytest.raises(ConfigError, match="data.max_prompt_length: applies to preference pairs"):
        load_config(tmp_path / "undecided.yaml", ["train.method=sft", "data.max_prompt_length=64"])
    with pytest.raises(ConfigError, match="data.objective"):
        load_config(path, ["data.objective=dpo"])
    with pytest.raises(ConfigError, match="data.dataset_schema: names an SFT row schema"):
        load_config(path, ["data.datasets=[{path: x.jsonl, schema: messages}]"])
    # train.method decides what a row is: dpo reads pairs unless data.objective says otherwise, which is refused
    assert load_config(path, ["data.objective=sft", "train.method=sft"]).data.objective == "sft"
    with pytest.raises(ConfigError, match="data.objective: train.method: dpo trains on preference pairs"):
        load_config(path, ["data.objective=sft", "train.method=dpo"])
    implicit = yaml.safe_load(path.read_text())
    del implicit["data"]["objective"]
    implicit["train"]["method"] = "orpo"
    path.write_text(yaml.safe_dump(implicit))
    assert load_config(path).data.objective == "preference"


def test_an_unexpected_error_in_a_pair_stage_is_a_bad_row_with_its_location(qwen3_tok, monkeypatch):
    from qlora_train.data import pairs

    def broken(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(pairs, "fit_pair", broken)
    out = process_rows([GOOD[0]], qwen3_tok, DataConfig(objective="preference"), locations=["f:1"])
    assert out["drop_reason"] == [DropReason.BAD_ROW]
    assert out["drop_detail"] == ["f:1: unexpected ValueError: a bug"]


def test_stats_only_and_debug_samples_on_pairs_through_the_cli(tmp_path, qwen_tokenizer_dir, pairs_file, capsys):
    cfg = write_config(tmp_path, qwen_tokenizer_dir, pairs_file, dedup=True)
    out = tmp_path / "stats"
    assert main(["--config", str(cfg), "--stats-only", "--debug-samples", "1", "--stats-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("pairs kept 6; tokens per pair (kept):", "prompt (shared)", "chosen response", "rejected response",
                 "refused pairs by reason: ", "truncated 0 pairs: middle prompt exchanges dropped 0",
                 f"--- {pairs_file}:1 chosen", f"--- {pairs_file}:1 rejected", "Jupiter.<|im_end|>\u27e7",
                 "Mars.<|im_end|>\u27e7"):
        assert line in printed, line
    stats = json.loads((out / "stats.json").read_text())
    pairs = stats["overall"]["pairs"]
    assert pairs["pairs_kept"] == 6 and pairs["refused"] == {reason: 1 for _, reason in BAD}
    assert pairs["prompt_tokens"]["p50"] > 0 and pairs["chosen_response_tokens"]["max"] > 0
    html = (out / "debug_samples.html").read_text()
    assert 'id="row-0-chosen"' in html and 'id="row-0-rejected"' in html


@pytest.fixture
def model_dir(tmp_path, qwen_tokenizer_dir):
    """The tokenizer and a model config.json, no weights (what --preprocess reads)."""
    from transformers import Qwen3Config

    path = tmp_path / "model"
    shutil.copytree(qwen_tokenizer_dir, path)
    Qwen3Config(num_hidden_layers=2).save_pretrained(path)
    return path


@pytest.mark.slow  # --preprocess through the CLI, then the data built twice: make test (CI) runs it
def test_preprocess_round_trip_keeps_the_pair_columns(tmp_path, model_dir, pairs_file):
    from qlora_train.data.prepared import training_data
    from qlora_train.tokenizer import load_tokenizer

    cfg_path = write_config(tmp_path, model_dir, pairs_file, eval_fraction=0.2)
    prepared = tmp_path / "prepared"
    assert main(["--config", str(cfg_path), "--preprocess", "--preprocess-dir", str(prepared)]) == 0
    cfg = load_config(cfg_path)
    tok = load_tokenizer(cfg.model)
    from_raw = training_data(cfg, tok)
    from_prepared = training_data(load_config(cfg_path, [f"data.prepared_path={prepared}"]), tok)
    assert from_prepared.train.column_names == list(PAIR_ROW.model_columns)
    assert from_prepared.train.to_list() == from_raw.train.to_list()
    assert from_prepared.eval.to_list() == from_raw.eval.to_list()
    assert from_prepared.report == from_raw.report
    with pytest.raises(ConfigError, match="data.objective"):  # SFT config on pair data: the fingerprint differs
        training_data(load_config(cfg_path, [f"data.prepared_path={prepared}", "data.objective=sft"]), tok)


def test_the_bundled_pair_sample_is_kept_whole(tmp_path, qwen3_tok):
    path = REPO / "configs" / "data" / "quickstart-pairs.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    train, _, report = build_datasets(data_config(tmp_path, [path]), qwen3_tok)
    assert report.rows_in == len(rows) == report.rows_kept == 24 and not report.dropped
    assert report.parse["tools_present"] == 2 and report.parse["schemas"] == {"preference": 24}
    formats = {canonicalize_pair(r).format for r in rows}
    assert formats == {"prompt_chosen_rejected", "instruction", "implicit_prompt", "hh_rlhf"}
