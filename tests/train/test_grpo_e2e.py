"""GRPO end to end on the tiny model: the shipped quickstart through the CLI (its summary, the per-step logs, held-out
prompts, the reward history; ``--preprocess`` then ``data.prepared_path`` samples the same completions;
``--generate`` after it), ``--stats-only`` / ``--debug-samples`` on its prompts, a run killed between the two steps
that share completions (``rl.num_iterations: 2``) resuming to the uninterrupted run's adapter, the sampler's token
in / token out, and every kind of bad input as one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qlora_train.cli import main
from qlora_train.config import load_config
from qlora_train.train.run import train
from tests.train.test_train_e2e import CountSteps, CrashAt

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "quickstart-grpo.yaml"
LOGGED = {"loss", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/max_length",
          "completions/truncated", "tokens_per_second", "rewards/matches/mean", "rewards/matches/std",
          "rewards/matches/none", "rewards/final_answer/mean", "rewards/final_answer/none", "clip_ratio/low_mean",
          "clip_ratio/high_mean", "clip_ratio/region_mean"}


def cli_args(tiny_model_dir, out, *more: str) -> list[str]:
    return ["--config", str(CONFIG), "--set", f"model.name_or_path={tiny_model_dir}", "--set",
            "model.adapter_path=null", "--set", f"train.output_dir={out}", "--set", "train.max_steps=2", "--set",
            "train.save_steps=2", *more]


def test_the_shipped_grpo_quickstart_through_the_cli(tmp_path, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.chdir(REPO / "configs")  # its data path is relative to it
    held_out = ["--set", "data.eval_fraction=0.15", "--set", "train.eval_steps=2", "--set", "rl.beta=0.04"]
    assert main(cli_args(tiny_model_dir, tmp_path / "raw", *held_out)) == 0
    out = capsys.readouterr().out
    assert ("method     grpo from a new adapter on the base; 8 completions of at most 4 tokens per prompt "
            "(temperature 0.1, top_p 1.0), loss dapo; reference: the base (the adapter switched off), KL weight "
            "rl.beta 0.04") in out
    assert "prompt tokens" in out and "(none trained: training samples each prompt's completions)" in out
    history = json.loads((tmp_path / "raw" / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 2 and all(LOGGED | {"kl"} <= set(h) for h in steps)
    assert all(h["completions/max_length"] <= 4 and 0 <= h["reward"] <= 1 for h in steps)
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # a fresh adapter is the reference at first
    assert any("eval_reward" in h and "eval_loss" in h for h in history)
    rewards = json.loads((tmp_path / "raw" / "reward_history.json").read_text())
    assert [r["step"] for r in rewards] == [1, 2] and (tmp_path / "raw" / "adapter_model.safetensors").is_file()

    prepared = tmp_path / "prepared"
    assert main(cli_args(tiny_model_dir, tmp_path / "p", *held_out, "--preprocess", "--preprocess-dir",
                         str(prepared))) == 0
    assert main(cli_args(tiny_model_dir, tmp_path / "prep", *held_out, "--set", f"data.prepared_path={prepared}")) == 0
    again = json.loads((tmp_path / "prep" / "reward_history.json").read_text())
    assert again == rewards  # the same prompts, the same seeded draws: the same completions and rewards

    assert main(["--config", str(CONFIG), "--set", f"model.name_or_path={tiny_model_dir}", "--set",
                 f"train.output_dir={tmp_path / 'raw'}", "--generate", "What is 2 + 2?", "--max-new-tokens", "3"]) == 0


def test_stats_and_debug_samples_of_prompts(tmp_path, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.chdir(REPO / "configs")
    common = ["--config", str(CONFIG), "--set", f"model.name_or_path={tiny_model_dir}", "--stats-dir", str(tmp_path)]
    assert main([*common, "--stats-only"]) == 0
    out = capsys.readouterr().out
    assert ("prompts kept 28; their limit 252 tokens (data.max_prompt_length; under train.method: grpo "
            "max_length=256 less rl.max_completion_length), 4 left for the completion:") in out
    stats = json.loads((tmp_path / "stats.json").read_text())["overall"]["prompts"]
    assert (stats["prompts_kept"], stats["limit"], stats["generation_prompt_tokens"]["max"]) == (28, 252, 3)
    assert main([*common, "--debug-samples", "1"]) == 0
    out = capsys.readouterr().out
    assert ("prompt: tokens 16 before truncation, 16 after, none trained (its completions are sampled in training, "
            "after it); the last 3 are the generation prompt's '<|im_start|>assistant\\n', prompt too") in out
    assert "⟦" not in out.split("--- ")[1]  # nothing marked trained


def grpo_config(tmp_path, tiny_model_dir, *overrides: str):
    return load_config(CONFIG, [f"model.name_or_path={tiny_model_dir}", "model.adapter_path=null",
                                f"train.output_dir={tmp_path / 'out'}", "train.max_steps=4", "train.save_steps=3",
                                "rl.num_iterations=2", "train.learning_rate=2e-2", "rl.temperature=1.0",
                                # the fresh tiny model draws tokens at random: some hold a vowel, some do not
                                "rl.rewards=[{function: 'qlora_train.rl.rewards:matches', "
                                "kwargs: {pattern: '[aeiou]'}}]",
                                *overrides])


def test_a_run_killed_between_steps_sharing_completions_resumes_to_the_uninterrupted_adapter(tmp_path, tiny_model_dir,
                                                                                          monkeypatch):
    """Steps 3 and 4 train on the completions sampled for step 3 (``rl.num_iterations: 2``); the run is killed after
    step 3's checkpoint, which keeps them (``rollouts.pt``): the resumed step 4 is the uninterrupted one."""
    from safetensors.torch import load_file

    monkeypatch.chdir(REPO / "configs")
    ref = train(grpo_config(tmp_path / "ref", tiny_model_dir))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(grpo_config(tmp_path / "run", tiny_model_dir), callbacks=[CrashAt(4)])
    assert (tmp_path / "run" / "out" / "checkpoint-3" / "rollouts.pt").is_file()
    steps = CountSteps()
    resumed = train(grpo_config(tmp_path / "run", tiny_model_dir), callbacks=[steps])
    assert (resumed.state.global_step, steps.count) == (4, 1)
    logged = [{h["step"]: h.get("loss") for h in t.state.log_history if "loss" in h} for t in (ref, resumed)]
    assert logged[1][4] == pytest.approx(logged[0][4], rel=1e-4, abs=1e-7)
    a, b = (load_file(tmp_path / run / "out" / "adapter_model.safetensors") for run in ("ref", "run"))
    assert a.keys() == b.keys()
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)  # it trained
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)


def test_the_sampler_keeps_the_ids_it_drew(tiny_model_dir):
    """Token in, token out: the seed decides the draw; a completion is cut after its first stop token and is ended
    when that is an end-of-turn token; one that runs to the limit is truncated."""
    from transformers import AutoModelForCausalLM

    from qlora_train.rl.rollout import Sampling, sample

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts, sampling = [[151644, 872, 198, 17, 151645, 198, 151644, 77091, 198], [9707, 30]], Sampling(3, 5, 1.0)
    first = sample(model, prompts, sampling, stop=(151645,), end=(151645,), pad_id=151643, seed=5)
    assert first.prompt_ids == [prompts[0]] * 3 + [prompts[1]] * 3
    assert [len(c) for c in first.completion_ids] == [5] * 6 and first.ended == [False] * 6  # random: never ends
    assert sample(model, prompts, sampling, stop=(151645,), end=(151645,), pad_id=151643, seed=5) == \
        first.__class__(first.prompt_ids, first.completion_ids, first.ended, pytest.approx(first.seconds, abs=1e9))
    stop = first.completion_ids[0][1]  # make the second token drawn for completion 0 a stop token
    cut = sample(model, prompts, sampling, stop=(stop,), end=(stop,), pad_id=151643, seed=5)
    assert cut.completion_ids[0] == first.completion_ids[0][:2] and cut.ended[0]
    eos_only = sample(model, prompts, sampling, stop=(stop,), end=(), pad_id=151643, seed=5)
    assert eos_only.completion_ids[0] == first.completion_ids[0][:2] and not eos_only.ended[0]  # not end of turn


REWARDS = "def raises(prompts, completions, answer, **kw):\n    return [float(a) for a in answer]\n"


@pytest.mark.parametrize(("overrides", "data", "says"), [
    (["rl.rewards=[{function: 'not_there:f'}]"], None,
     "error: rl.rewards[0].function: cannot import not_there: No module named 'not_there'"),
    (["rl.rewards=[{function: 'bad_rewards:raises'}]"], None,
     "error: rl.rewards[0] (bad_rewards:raises) raised ValueError: could not convert string to float: "),
    ([], [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}] * 3,
     "error: all 3 rows were dropped (prompt_ends_with_assistant): every prompt ends with an assistant turn"),
    (["rl.max_completion_length=256"], None,
     "  rl.max_completion_length: 256 leaves no room for the prompt within data.max_length 256"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_model_dir, monkeypatch, capsys, overrides, data, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad_rewards.py").write_text(REWARDS)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in data or [{"prompt": "2+2?", "answer": "four"}] * 3) + "\n")
    args = cli_args(tiny_model_dir, tmp_path / "out", "--set", f"data.datasets=[{{path: {rows}}}]")
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count(says) == 1, err
    problem = err[err.index(says):].split("\n")  # after it: nothing but a progress bar's last refresh
    assert all(not line.strip() or "it/s]" in line for line in problem[1:]), err
    if "raises" in says:
        assert problem[0].endswith(f"at bad_rewards.py:2, on row {rows}:1: the run stops at a reward function's "
                                   "first error")
