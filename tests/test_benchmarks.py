"""The benchmark's reference methods, checked against the pipeline (they must compute the same masks)."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from qlora_train.data import DataConfig, canonicalize_row, process_rows
from qlora_train.masking.tokenize import IGNORE_INDEX

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_preprocess.py"


def load_bench(name: str):
    """benchmarks/<name>.py as a module (registered under its name: dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, BENCH.with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_bench("bench_preprocess")


@pytest.fixture(scope="module")
def generation_tok(family_tokenizers, bench):
    tok = copy.deepcopy(family_tokenizers["chatml"])
    tok.chat_template = bench.GENERATION_TEMPLATE.read_text()
    return tok


def test_rows_are_deterministic(bench):
    assert bench.make_rows(5) == bench.make_rows(5) != bench.make_rows(5, seed=1)
    assert [r for r in bench.iter_rows(3)] == bench.make_rows(3)


def test_reference_masks_match_the_pipeline(bench, generation_tok):
    rows = bench.make_rows(24)
    cfg = DataConfig(max_length=4096)
    canon = [canonicalize_row(r, cfg) for r in rows]
    trained = [[lab != IGNORE_INDEX for lab in labels] for labels in bench.pipeline(rows, generation_tok, cfg)]
    # prefix re-rendering is exact on a template whose prefixes render identically (ChatML)
    assert [[bool(m) for m in mask] for mask in bench.prefix_rerender(canon, generation_tok)] == trained
    # transformers' generation-tag masks: the render tokenized whole, so a turn whose first characters merge with
    # its header's (header "\n" + a call turn's "\n<tool_call>") has a token fewer; on the other rows they differ
    # only on tokens that straddle a span edge
    hf = bench.hf_assistant_mask(canon, generation_tok)
    merged = [len(t) - len(m) for m, t in zip(hf, trained)]
    assert min(merged) == 0 and max(merged) > 0  # (the generated rows do have some)
    straddling = sum(process_rows(rows, generation_tok, cfg)["straddling_tokens"])
    differ = sum(bool(m) != t for mask, tr in zip(hf, trained) if len(mask) == len(tr) for m, t in zip(mask, tr))
    assert differ <= straddling
    share, apart = bench.agreement(bench.pipeline(rows, generation_tok, cfg), hf)
    assert share > 0.99 and apart == sum(n > 0 for n in merged)


@pytest.fixture(scope="module")
def bench_rows(bench):
    return sys.modules["bench_rows"]  # imported by bench_preprocess


def test_every_distribution_is_deterministic_and_processes_without_a_drop(bench_rows, qwen3_tok):
    """Each row distribution holds the properties it names, and the pipeline keeps every row of it."""
    cfg = DataConfig(max_length=4096, reasoning_history="drop")
    seen: dict[str, set] = {}
    for name in bench_rows.NAMES:
        rows = bench_rows.rows(name, 12)
        assert rows == bench_rows.rows(name, 12) != bench_rows.rows(name, 12, seed=1)
        out = process_rows(rows, qwen3_tok, cfg)
        assert not any(out["drop_reason"]), (name, [d for d in out["drop_detail"] if d])
        seen[name] = {k for r in out["parse_report"] for k, v in json.loads(r).items() if v and k != "rows"}
    assert {"moved_reasoning_keys", "extracted_think_from_content", "reasoning_dropped_tokens"} <= seen["reasoning"]
    assert "tools_parsed_from_string" in seen["agent"]
    assert {"prompt_response", "sharegpt", "alpaca"} <= {s for r in bench_rows.rows("sft", 12)
                                                          for s in [canonicalize_row(r, cfg).report.schema]}
    assert any(isinstance(m["content"], list) for r in bench_rows.rows("unicode", 12) for m in r["messages"])


@pytest.fixture(scope="module")
def bench_train():
    return load_bench("bench_train")


def test_train_bench_rows_train_a_third_of_the_tokens(bench_train):
    rows = bench_train.rows(512, 2)
    assert rows == bench_train.rows(512, 2) and rows[0]["input_ids"] != rows[1]["input_ids"]
    for row in rows:
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["attention_mask"]) == 512
        trained = [i for i, lab in enumerate(row["labels"]) if lab != IGNORE_INDEX]
        assert len(trained) == 2 * 85 and trained[:2] == [171, 172]
        assert all(row["labels"][i] == row["input_ids"][i] for i in trained)


def test_train_bench_skips_what_would_not_fit(bench_train):
    """Under a 9 GiB cap the issue's target point (4,096 tokens) runs and 8,192 tokens of default loss do not."""
    assert bench_train.estimate_gib("default", 2048 * 2) < 9 < bench_train.estimate_gib("default", 2048 * 4)
    assert bench_train.estimate_gib("fused", 4096 * 4) < 3


def test_train_bench_table_and_target_line(bench_train, capsys):
    def run(peak, cpu, loss):
        return {"peak_gib": peak, "before_gib": 0.5, "cuda_peak_gib": None, "device": "cpu", "step_wall": cpu,
                "step_cpu": cpu, "losses": [loss]}

    results = {(2048, 4): {"default": {"skipped": 15.7}, "fused": run(1.3, 1.0, 11.9)},
               (2048, 2): {"default": run(8.0, 6.0, 11.95), "fused": run(1.6, 2.0, 11.95002)}}
    bench_train.print_table(results, argparse.Namespace(steps=4, repeats=1))
    out = capsys.readouterr().out
    assert "2048     4 default  skipped (needs ~16 GiB)" in out
    assert "2048     2   fused                     1.60   1.10      20.0%" in out
    assert ("target 2048 tokens x batch 2: fused peak 20.0% of default (goal <= 35%: met); step time fused / "
            "default 0.33 wall, 0.33 cpu (goal <= 1: met); first losses differ by 2.0e-05 (goal <= 1e-4: met)") in out


@pytest.fixture(scope="module")
def bench_dpo():
    return load_bench("bench_dpo")


def test_dpo_bench_pairs_are_the_same_tokens_for_both_trainers(bench_dpo):
    """TRL's form (prompt_ids + chosen_ids) and ours (chosen_input_ids, the prompt masked) are one pair; responses
    are a third of a side and differ between chosen and rejected."""
    pairs = bench_dpo.pairs(300, 2)
    assert pairs == bench_dpo.pairs(300, 2) and pairs[0]["prompt_ids"] != pairs[1]["prompt_ids"]
    for p in pairs:
        assert len(p["prompt_ids"]) == 200 and len(p["chosen_ids"]) == len(p["rejected_ids"]) == 100
        assert p["chosen_ids"] != p["rejected_ids"]
        for side in ("chosen", "rejected"):
            assert p[f"{side}_input_ids"] == p["prompt_ids"] + p[f"{side}_ids"]
            assert p[f"{side}_labels"] == [IGNORE_INDEX] * 200 + p[f"{side}_ids"]


def test_dpo_bench_target_fits_and_table_compares_with_trl(bench_dpo, capsys):
    tokens = 2 * bench_dpo.TARGET[0] * bench_dpo.TARGET[1]
    assert bench_dpo.estimate_gib("ours", tokens) < bench_dpo.estimate_gib("trl", tokens) < 9

    def run(peak, cpu, loss):
        return {"peak_gib": peak, "before_gib": 0.5, "cuda_peak_gib": None, "device": "cpu", "step_wall": cpu,
                "step_cpu": cpu, "losses": [loss], "lora_dtype": "float32"}

    results = {(2048, 2): {"ours": run(1.5, 3.0, 0.693147), "trl": run(3.0, 6.0, 0.6931475)}}
    bench_dpo.print_table(results, argparse.Namespace(steps=3, repeats=1))
    out = capsys.readouterr().out
    assert ("2048     2   ours                     1.50   1.00    50.0% (+40.0%)      3.00     3.00    0.50x    "
            "0.693147") in out
    assert ("target 2048-token sides x batch 2: our peak 50.0% of TRL's (1.00 vs 2.50 GiB over load: 40.0%); "
            "step time ours / TRL 0.50 wall, 0.50 cpu; first losses within") in out


@pytest.fixture(scope="module")
def bench_grpo():
    return load_bench("bench_grpo")


def test_grpo_bench_prompts_reward_and_table(bench_grpo, capsys):
    """Both trainers get the same prompts (system + question messages); the reward varies from completion to
    completion; the table prints our peak and step time as shares of TRL's and the verdict on the 0.5x target."""
    prompts = bench_grpo.messages(4)
    assert prompts == bench_grpo.messages(4) and len({p[1]["content"] for p in prompts}) == 4
    said = bench_grpo.latin(None, [[{"role": "assistant", "content": t}] for t in (" Hello", "你好", "7 is")])
    assert said == [1.0, 0.0, 0.0]

    def run(peak, wall):
        return {"peak_gib": peak, "before_gib": 0.5, "cuda_peak_gib": None, "device": "cpu", "step_wall": wall,
                "step_cpu": 2 * wall, "tokens": 2048, "reward": 0.5, "lora_dtype": "float32"}

    bench_grpo.print_table({"ours": run(0.9, 6.0), "trl": run(3.0, 15.0)}, argparse.Namespace(steps=3, repeats=1))
    out = capsys.readouterr().out
    assert "  ours   0.90   0.40      6.00    12.00   2048  float32" in out
    assert ("ours / TRL: peak memory 0.30x (0.40 vs 2.50 GiB over load: 16.0%) (meets the target <= 0.5x); step time "
            "0.40x wall, 0.40x cpu") in out


@pytest.fixture(scope="module")
def mask_audit():
    yield load_bench("mask_audit")
    del sys.modules["mask_audit"]


def test_the_mask_audit_accounts_for_every_row(mask_audit, qwen_tokenizer_dir, capsys):
    audits = [mask_audit.audit("zephyr", "qwen+tok", 12, 0, str(qwen_tokenizer_dir))]
    a = audits[0]
    assert a.rows == a.kept + a.refused == 12 and a.decided and not a.text_differs
    assert a.refused_decided + a.refused_expected <= a.refused and a.undecided <= a.kept
    assert (a.wrong, a.missed, a.weak) == (0, 0, 0)  # a layout the engine handles
    mask_audit.print_table(audits)
    assert "zephyr" in capsys.readouterr().out and mask_audit.summary(audits).startswith("TOTAL 1 template")
    pairs = mask_audit.audit_pairs("zephyr", "qwen+tok", 12, 0, str(qwen_tokenizer_dir))
    assert pairs.rows == pairs.kept + pairs.refused == 12 and pairs.decided and not pairs.text_differs
    assert (pairs.wrong, pairs.missed, pairs.refused_decided) == (0, 0, 0)
    prompt, chosen, rejected = mask_audit.as_pair(1, [{"role": "user", "content": "q"}, {"role": "assistant",
                                                                                       "content": "a"}])
    assert (prompt, chosen, rejected) == ([{"role": "user", "content": "q"}], [{"role": "assistant", "content": "a"}],
                                          [{"role": "assistant", "content": "a different answer:\na"}])
    assert mask_audit.short_reason("mask_unverified", "row 3: messages[2]: no assistant turn opener ['x'] after "
                                   "char 191") == "mask_unverified: no assistant turn opener"


def test_the_mask_audit_writes_hostile_rows_and_counts_their_refusals_apart(mask_audit, qwen_tokenizer_dir):
    """Every row hostile on a ChatML template (role names written verbatim): the rows whose role, tool name,
    argument name or schema holds a marker are refused for it, the others trained as the oracle says."""
    a = mask_audit.audit("chatml", mask_audit.OURS, 16, 0, str(qwen_tokenizer_dir), hostile=1.0)
    assert a.rows == a.kept + a.refused == 16 and a.refused_marker and a.kept and not a.text_differs
    assert (a.wrong, a.missed, a.weak, a.refused_decided) == (0, 0, 0, 0)
    assert a.reasons[mask_audit.short_reason("marker_in_row_text", "row 0: messages[1].role holds")] > 0


def test_the_peers_bench_gives_llamafactory_the_same_rows_in_its_sharegpt_form(bench):
    """bench_peers.py: every message's text reaches LLaMA-Factory, in the order and alternation its sharegpt reader
    needs (user or observation, then assistant or function_call), a tool call as its name and arguments."""
    peers = load_bench("bench_peers")
    rows = bench.make_rows(40)
    asking, answering = {"user", "observation"}, {"assistant", "function_call"}
    calls = 0
    for row in rows:
        converted = peers.sharegpt(row)
        messages = converted["messages"]
        assert messages[0]["role"] == "system" and messages[0]["content"] == row["messages"][0]["content"]
        turns = messages[1:]
        assert [m["role"] in (asking if i % 2 == 0 else answering) for i, m in enumerate(turns)] == [True] * len(turns)
        for m, original in zip(turns, row["messages"][1:]):
            if m["role"] == "function_call":
                call = original["tool_calls"][0]["function"]
                assert json.loads(m["content"]) == {"name": call["name"], "arguments": call["arguments"]}
                calls += 1
            else:
                assert m["content"] == original["content"]
        assert ("tools" in converted) == ("tools" in row)
    assert calls > 0
