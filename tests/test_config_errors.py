"""Bad configs: the CLI prints every problem on its own line, naming the key path, and exits 2 (no traceback).

Each case is a whole YAML file; ``DATA`` stands for an existing data file.
"""

from __future__ import annotations

import pytest

from qlora_train.cli import main
from qlora_train.config import ConfigError, load_config

MODEL = "model: {name_or_path: Qwen/Qwen3-0.6B}\n"
DATASETS = "data: {datasets: [{path: DATA}]}\n"
GOOD = MODEL + DATASETS

BAD = [
    # unknown keys, with a did-you-mean
    ("unknown-section", GOOD + "trian: {max_steps: 3}", "trian: unknown key (did you mean 'train'?)"),
    ("unknown-data-key", MODEL + "data: {datasets: [{path: DATA}], max_lenght: 5}",
     "data.max_lenght: unknown key (did you mean 'max_length'?)"),
    ("unknown-model-key", "model: {name_or_path: Qwen/Qwen3-0.6B, load_in4bit: true}\n" + DATASETS,
     "model.load_in4bit: unknown key (did you mean 'load_in_4bit'?)"),
    ("unknown-source-key", MODEL + "data: {datasets: [{pth: DATA}]}",
     "data.datasets[0].pth: unknown key (did you mean 'path'?)"),
    # wrong types
    ("lr-not-a-number", GOOD + "train: {learning_rate: fast}", "train.learning_rate: Input should be a valid number"),
    ("max-length-not-int", MODEL + "data: {datasets: [{path: DATA}], max_length: long}",
     "data.max_length: Input should be a valid integer"),
    ("rank-fractional", GOOD + "lora: {r: 8.5}", "lora.r: Input should be a valid integer"),
    ("section-not-mapping", "model: Qwen/Qwen3-0.6B\n" + DATASETS, "model: Input should be a valid dictionary"),
    ("required-key-missing", "model: {chat_template: qwen3}\n" + DATASETS, "model.name_or_path: Field required"),
    ("required-section-missing", DATASETS + "lora: {r: 8}", "model: Field required"),
    ("resume-false", GOOD + "train: {resume_from_checkpoint: false}",
     "train.resume_from_checkpoint: false: a rerun does not start over silently"),
    # enums
    ("think-loss-enum", MODEL + "data: {datasets: [{path: DATA}], think_loss: most}",
     "data.think_loss: Input should be 'all', 'answer_only' or 'answer_plus_think'"),
    ("scheduler-enum", GOOD + "train: {lr_scheduler: cosin}", "train.lr_scheduler: Input should be 'linear'"),
    ("builder-enum", MODEL + "data: {datasets: [{path: DATA, builder: xml}]}",
     "data.datasets[0].builder: Input should be 'json', 'parquet', 'csv' or 'arrow'"),
    ("on-bad-row-enum", MODEL + "data: {datasets: [{path: DATA}], on_bad_row: ignore}",
     "data.on_bad_row: Input should be 'skip' or 'error'"),
    ("on-too-long-enum", MODEL + "data: {datasets: [{path: DATA}], on_too_long: cut}",
     "data.on_too_long: Input should be 'truncate' or 'drop'"),
    # impossible values
    ("max-length-zero", MODEL + "data: {datasets: [{path: DATA}], max_length: 0}",
     "data.max_length: Input should be greater than or equal to 1"),
    ("max-steps-zero", GOOD + "train: {max_steps: 0}", "train.max_steps: must be -1 (train num_epochs) or at least 1"),
    ("eval-fraction-one", MODEL + "data: {datasets: [{path: DATA}], eval_fraction: 1.0}",
     "data.eval_fraction: Input should be less than 1"),
    ("negative-dropout", GOOD + "lora: {dropout: -0.1}", "lora.dropout: Input should be greater than or equal to 0"),
    ("no-assistant-roles", MODEL + "data: {datasets: [{path: DATA}], assistant_roles: []}",
     "data.assistant_roles: name at least one role"),
    ("no-target-modules", GOOD + "lora: {target_modules: []}",
     "lora.target_modules: name at least one module, or use all-linear"),
    # conflicting options
    ("packing-and-group-by-length", GOOD + "train: {packing: true, group_by_length: true}",
     "train.group_by_length: cannot be used with packing: true"),
    ("split-long-without-packing", GOOD + "train: {split_long: true}", "train.split_long: needs packing: true"),
    ("4bit-and-8bit", "model: {name_or_path: Qwen/Qwen3-0.6B, load_in_8bit: true}\n" + DATASETS,
     "model.load_in_8bit: cannot be true together with load_in_4bit (pick one)"),
    ("drop-think-but-train-it", MODEL + "data: {datasets: [{path: DATA}], think_mode: drop, "
     "think_loss: answer_plus_think}", "data.think_loss: answer_plus_think trains reasoning, but think_mode: drop"),
    ("drop-think-but-cap-it", MODEL + "data: {datasets: [{path: DATA}], think_mode: drop, think_max_tokens: 64}",
     "data.think_max_tokens: caps reasoning, but think_mode: drop removes it (set 0)"),
    # GRPO (train.method: grpo, the rl section)
    ("grpo-without-rewards", GOOD + "train: {method: grpo}",
     "rl.rewards: train.method: grpo needs at least one reward function"),
    ("grpo-no-room-for-the-prompt", MODEL + "data: {datasets: [{path: DATA}], max_length: 256}\n"
     "train: {method: grpo}\nrl: {rewards: [{function: 'a.b:c'}], max_completion_length: 256}",
     "rl.max_completion_length: 256 leaves no room for the prompt within data.max_length 256"),
    ("grpo-prompt-limit-too-large", MODEL + "data: {datasets: [{path: DATA}], max_length: 256, max_prompt_length: 200}"
     "\ntrain: {method: grpo}\nrl: {rewards: [{function: 'a.b:c'}], max_completion_length: 64}",
     "data.max_prompt_length: 200 + rl.max_completion_length 64 > data.max_length 256"),
    ("grpo-reward-name", GOOD + "train: {method: grpo}\nrl: {rewards: [{function: rewards.py}]}",
     "rl.rewards[0].function: 'rewards.py': expected 'package.module:name'"),
    ("grpo-packing", GOOD + "train: {method: grpo, packing: true}\nrl: {rewards: [{function: 'a.b:c'}]}",
     "train.packing: not available with method: grpo"),
    ("grpo-fsdp", GOOD + "train: {method: grpo, distributed: fsdp}\nrl: {rewards: [{function: 'a.b:c'}]}",
     "train.distributed: fsdp with method: grpo is not supported yet"),
    ("rl-without-grpo", GOOD + "rl: {num_generations: 4}", "rl: the rl section configures train.method: grpo"),
    ("one-generation", GOOD + "train: {method: grpo}\nrl: {rewards: [{function: 'a.b:c'}], num_generations: 1}",
     "rl.num_generations: Input should be greater than or equal to 2"),
    # missing files
    ("no-datasets", MODEL, "data.datasets: name at least one data source"),
    ("dataset-not-found", MODEL + "data: {datasets: [{path: DATA}, {path: nope.jsonl}]}",
     "data.datasets[1].path: file not found: nope.jsonl"),
    ("glob-matches-nothing", MODEL + "data: {datasets: [{path: nowhere/*.jsonl}]}",
     "data.datasets[0].path: no file matches the glob nowhere/*.jsonl"),
    ("local-model-missing", "model: {name_or_path: ./models/none}\n" + DATASETS,
     "model.name_or_path: local directory not found: ./models/none"),
    ("local-tokenizer-missing", "model: {name_or_path: Qwen/Qwen3-0.6B, tokenizer: /nonexistent/tok}\n" + DATASETS,
     "model.tokenizer: local directory not found: /nonexistent/tok"),
    ("template-file-missing", "model: {name_or_path: Qwen/Qwen3-0.6B, chat_template: mine.jinja}\n" + DATASETS,
     "model.chat_template: template file not found: mine.jinja"),
    ("template-unknown", "model: {name_or_path: Qwen/Qwen3-0.6B, chat_template: qwen4}\n" + DATASETS,
     "model.chat_template: unknown template 'qwen4' (did you mean 'qwen3'?)"),
    ("template-kwarg-name", "model: {name_or_path: Qwen/Qwen3-0.6B, chat_template_kwargs: {enable-thinking: 0}}\n"
     + DATASETS, "model.chat_template_kwargs.enable-thinking: is not a template variable name"),
    ("template-kwarg-value", "model: {name_or_path: Qwen/Qwen3-0.6B, chat_template_kwargs: {day: 2025-01-01}}\n"
     + DATASETS, "model.chat_template_kwargs.day: datetime.date(2025, 1, 1) cannot be written into a template"),
    ("resume-missing", GOOD + "train: {resume_from_checkpoint: runs/checkpoint-9}",
     "train.resume_from_checkpoint: checkpoint directory not found: runs/checkpoint-9"),
    ("output-dir-is-a-file", GOOD + "train: {output_dir: DATA}", "train.output_dir: is a file, not a directory"),
]


@pytest.fixture
def data_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths in the cases resolve here, where they do not exist
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "q", "response": "a"}\n')
    return path


def write(tmp_path, text: str, data_file) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("DATA", str(data_file)))
    return str(path)


def test_there_are_at_least_20_distinct_bad_configs():
    assert len({text for _, text, _ in BAD}) == len(BAD) >= 20


def test_the_good_base_config_validates(tmp_path, data_file):
    cfg = load_config(write(tmp_path, GOOD, data_file))
    assert cfg.data.datasets[0].path == str(data_file) and cfg.model.name_or_path == "Qwen/Qwen3-0.6B"


@pytest.mark.parametrize("text, problem", [(t, p) for _, t, p in BAD], ids=[name for name, _, _ in BAD])
def test_cli_names_the_key_and_exits_2(tmp_path, data_file, capsys, text, problem):
    path = write(tmp_path, text, data_file)
    assert main(["--config", path]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == f"invalid config {path}:"
    assert any(line.startswith(f"  {problem}") for line in lines[1:]), err
    assert "Traceback" not in err
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert len(exc.value.problems) == len(lines) - 1  # one line per problem


def test_every_problem_is_listed_at_once(tmp_path, data_file, capsys):
    text = ("model: {name_or_path: ./gone, load_in_8bit: true}\n"
            "data: {datasets: [{path: missing.jsonl}], max_length: 0}\ntrain: {lerning_rate: 1}\n")
    assert main(["--config", write(tmp_path, text, data_file)]) == 2
    problems = [line.strip() for line in capsys.readouterr().err.splitlines()[1:]]
    assert sorted(problems) == sorted([
        "model.load_in_8bit: cannot be true together with load_in_4bit (pick one)",
        "data.max_length: Input should be greater than or equal to 1",
        "train.lerning_rate: unknown key (did you mean 'learning_rate'?)",
        "data.datasets[0].path: file not found: missing.jsonl",
        "model.name_or_path: local directory not found: ./gone (a hub id looks like 'org/name')",
    ])


@pytest.mark.parametrize("overrides, problem", [
    (["data.max_length=[1"], "--set data.max_length: value '[1' is not valid YAML"),
    (["data.max_length"], "--set 'data.max_length': expected key.path=value"),
    (["data.max_length=-3"], "data.max_length: Input should be greater than or equal to 1"),
])
def test_bad_overrides_exit_2(tmp_path, data_file, capsys, overrides, problem):
    args = ["--config", write(tmp_path, GOOD, data_file)]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == 2
    assert f"  {problem}" in capsys.readouterr().err.splitlines()


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "none.yaml")]) == 2
    assert f"config file not found: {tmp_path / 'none.yaml'}" in capsys.readouterr().err


def test_hub_ids_and_local_paths_are_told_apart():
    """One rule for the config check and the loader (``locations``): the loader used to take ``_x/y`` and
    ``.cache/m`` for hub ids that the validator called local paths."""
    from qlora_train.locations import looks_like_hub_id

    assert [looks_like_hub_id(v) for v in ("Qwen/Qwen3-1.7B", "gpt2", "HuggingFaceH4/ultrachat_200k")] == [True] * 3
    assert [looks_like_hub_id(v) for v in (".cache/tiny-qwen3", "./m", "/abs/m", "~/m", "a/b/c", "data/x.jsonl",
                                           "_x/y", "x/_y", "d/x.PARQUET")] == [False] * 9
