"""``--preprocess`` and ``data.prepared_path``: the saved datasets are exactly what training builds from the raw
files, and a directory prepared with other settings, or damaged, is refused naming what differs (exit 2)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qlora_train.cli import main
from qlora_train.config import ConfigError, load_config
from qlora_train.data.prepared import (
    FINGERPRINT_FILE,
    check_prepared,
    differing_keys,
    fingerprint,
    training_data,
    write_prepared,
)
from qlora_train.data.prepared_checks import shard_hashes
from qlora_train.tokenizer import load_tokenizer

# --preprocess round trips and subprocesses (~45 s on 2 cores): make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def rows() -> list:
    """Multi-turn rows with reasoning (Qwen3 drops earlier turns' reasoning: expanded examples), tools, a
    duplicate, a refused row, other schemas and a long plain text (cut into blocks)."""
    out = []
    for i in range(24):
        msgs = [{"role": "system", "content": f"system {i}"}]
        for t in range(1 + i % 3):
            msgs += [{"role": "user", "content": f"question {i}.{t} " + "word " * (i % 7)},
                     {"role": "assistant", "content": f"<think>thinking {i}.{t}</think>answer {i}.{t}"}]
        out.append({"messages": msgs, **({"tools": [{"type": "function", "function": {"name": "f"}}]}
                                         if i % 5 == 0 else {})})
    out.append(out[3])  # duplicate
    out.append({"messages": [{"role": "user", "content": "no answer"}]})  # refused: nothing to train
    out += [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(6)]
    out += [{"text": f"long text {i} " * 60} for i in range(3)]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, qwen_tokenizer_dir):
    """The Qwen tokenizer and a model config.json, no weights: all that --preprocess and the checks before the
    model loads read."""
    from transformers import Qwen3Config

    path = tmp_path_factory.mktemp("model")
    shutil.copytree(qwen_tokenizer_dir, path, dirs_exist_ok=True)
    Qwen3Config(num_hidden_layers=2).save_pretrained(path)
    return path


def write_project(tmp_path: Path, tokenizer_dir: Path, *, data: dict | None = None, train: dict | None = None,
                  name: str = "cfg.yaml") -> Path:
    """A config beside its data file (a path relative to the YAML), training on CPU with the tokenizer only."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    data_file = tmp_path / "data" / "rows.jsonl"
    if not data_file.exists():
        data_file.parent.mkdir(exist_ok=True)
        data_file.write_text("\n".join(json.dumps(r) for r in rows()) + "\n")
    cfg = {"model": {"name_or_path": str(tokenizer_dir), "chat_template": "qwen3"},
           "data": {"datasets": [{"path": "data/rows.jsonl"}], "max_length": 96, "eval_fraction": 0.2,
                    "dedup": True, "shuffle": True, "cache_dir": str(tmp_path / "hf-cache"), **(data or {})},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none", **(train or {})}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def columns(ds) -> dict | None:
    return None if ds is None else {"features": ds.features.to_dict(), **ds.to_dict()}


def assert_same_training_data(a, b):
    assert columns(a.train) == columns(b.train)
    assert columns(a.eval) == columns(b.eval)
    assert a.report == b.report
    assert a.packing == b.packing


MODEL = ["input_ids", "attention_mask", "labels", "images"]  # images: references ([] in a text row)
PACKED = ["input_ids", "labels", "position_ids", "seq_lens"]


@pytest.mark.parametrize(("train", "fed_columns"), [
    ({}, MODEL), ({"packing": True, "split_long": True}, PACKED), ({"group_by_length": True}, [*MODEL, "length"]),
], ids=["plain", "packing", "group_by_length"])
def test_training_from_prepared_data_gets_exactly_the_examples_of_the_raw_files(tmp_path, model_dir, train,
                                                                                   fed_columns):
    cfg_path = write_project(tmp_path, model_dir, train=train)
    prepared = tmp_path / "prepared"
    assert main(["--config", str(cfg_path), "--preprocess", "--preprocess-dir", str(prepared)]) == 0
    raw_cfg = load_config(cfg_path)
    tok = load_tokenizer(raw_cfg.model)
    from_raw = training_data(raw_cfg, tok)

    shutil.rmtree(tmp_path / "data")  # the raw files are not read, and need not exist
    shutil.rmtree(tmp_path / "hf-cache")
    prep_cfg = load_config(cfg_path, [f"data.prepared_path={prepared}"])
    assert prep_cfg.data.datasets == raw_cfg.data.datasets  # resolved beside the YAML as when prepared
    from_prepared = training_data(prep_cfg, tok)

    assert_same_training_data(from_raw, from_prepared)
    r = from_raw.report
    assert r.expanded_examples > 0 and r.duplicates == 1 and r.dropped and r.text_blocks_added > 0 and r.eval_rows
    assert from_prepared.train.column_names == fed_columns
    assert (from_prepared.packing is not None) == bool(train.get("packing"))


def test_what_a_prepared_directory_holds(tmp_path, model_dir):
    cfg = load_config(write_project(tmp_path, model_dir))
    tok = load_tokenizer(cfg.model)
    data = write_prepared(cfg, tok, tmp_path / "p")
    names = {str(p.relative_to(tmp_path / "p")) for p in (tmp_path / "p").rglob("*") if p.is_file()}
    assert {"fingerprint.json", "dataset_report.json", "data_config.yaml", "train/state.json", "eval/state.json",
            "rows/raw/state.json", "rows/processed/state.json", "images.json"} <= names
    assert json.loads((tmp_path / "p" / "images.json").read_text()) == []  # text rows refer to no image
    assert not (tmp_path / ".p.tmp").exists()
    saved = json.loads((tmp_path / "p" / FINGERPRINT_FILE).read_text())
    assert saved["fingerprint"] == fingerprint(cfg, tok)["fingerprint"]
    assert set(saved["parts"]) == {"data", "tokenizer", "template", "layout", "code", "packing", "images"}
    assert saved["layout"]["end_markers"] == ["<|im_end|>"]  # the resolved layout, part by part
    assert json.loads((tmp_path / "p" / "dataset_report.json").read_text())["train_rows"] == data.report.train_rows
    assert yaml.safe_load((tmp_path / "p" / "data_config.yaml").read_text())["max_length"] == 96


def test_the_fingerprint_ignores_how_rows_are_computed_and_where_they_are_kept(tmp_path, model_dir):
    cfg = load_config(write_project(tmp_path, model_dir))
    tok = load_tokenizer(cfg.model)
    base = fingerprint(cfg, tok)
    same = cfg.model_copy(update={"data": cfg.data.model_copy(update={
        "num_proc": 2, "batch_size": 7, "cache_dir": "/elsewhere", "prepared_path": "x",
        "datasets": [cfg.data.datasets[0].model_copy(update={"path": str(Path(cfg.data.datasets[0].path)
                                                                            .resolve())})]})})
    assert fingerprint(same, tok) == base == fingerprint(cfg, tok)
    longer = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": 97})})
    assert fingerprint(longer, tok)["parts"] == {**base["parts"], "data": fingerprint(longer, tok)["parts"]["data"]}
    assert fingerprint(longer, tok)["fingerprint"] != base["fingerprint"]


def test_differing_keys_names_nested_keys_and_sources():
    a = {"max_length": 1, "mask": {"user": "mask"}, "datasets": [{"path": "a.jsonl", "weight": None}]}
    b = {"max_length": 1, "mask": {"user": "train"}, "datasets": [{"path": "b.jsonl", "weight": None}]}
    assert differing_keys(a, b) == ['datasets[0].path: "a.jsonl" when prepared, "b.jsonl" now',
                                    'mask.user: "mask" when prepared, "train" now']
    assert differing_keys(a, a) == []
    assert differing_keys({"x": 1}, {}) == ["x: 1 when prepared, (absent) now"]
    assert differing_keys({"mask": None}, {"mask": {"user": "train"}}) == [
        'mask: null when prepared, {"user": "train"} now']


@pytest.fixture(scope="module")
def prepared_project(tmp_path_factory, model_dir):
    """A config and the directory --preprocess wrote for it (data.prepared_path, its default --preprocess-dir)."""
    tmp = tmp_path_factory.mktemp("prepared")
    cfg_path = write_project(tmp, model_dir, data={"prepared_path": str(tmp / "prepared")})
    assert main(["--config", str(cfg_path), "--preprocess"]) == 0
    assert (tmp / "prepared" / FINGERPRINT_FILE).is_file()
    return cfg_path


@pytest.mark.parametrize(("overrides", "expected"), [
    (["data.max_length=128"], ["data.max_length: 96 when prepared, 128 now"]),
    (["model.chat_template_kwargs={enable_thinking: false}"], ["the chat template differs"]),
    (["model.chat_template=chatml"], ["the chat template differs"]),
    (["model.template_layout={end_markers: ['<|im_end|>', '<|endoftext|>']}"],
     ["the chat template differs", 'the template layout differs: end_markers: ["<|im_end|>"] when prepared, '
      '["<|im_end|>", "<|endoftext|>"] now']),
    (["train.packing=true"], ["the packing settings differ: prepared without packing, now packing_length=96, "
                              "split_long=False"]),
    (["data.mask={user: train}", "data.train_on_eos=all"],
     ['data.mask: null when prepared, {"user": "train"} now', 'data.train_on_eos: "turn" when prepared, "all" now']),
])
def test_a_mismatched_fingerprint_is_a_config_error_naming_what_differs(prepared_project, overrides, expected,
                                                                         capsys):
    capsys.readouterr()
    code = main(["--config", str(prepared_project), *[a for o in overrides for a in ("--set", o)]])
    err = capsys.readouterr().err
    assert code == 2
    for line in expected:
        assert f"data.prepared_path: {prepared_project.parent / 'prepared'} was prepared differently: {line}" in err
    assert "run `qlora-train --config … --preprocess` again" in err


def test_a_probe_that_reads_the_same_template_differently_refuses_the_data(prepared_project, monkeypatch):
    import dataclasses

    from qlora_train.masking import layout_declaration as declaration

    probe = declaration.probe_layout
    monkeypatch.setattr(declaration, "_LAYOUTS", {})
    monkeypatch.setattr(declaration, "probe_layout", lambda tok: dataclasses.replace(probe(tok), answer_open="<x>"))
    cfg = load_config(prepared_project)
    with pytest.raises(ConfigError) as err:
        check_prepared(cfg, load_tokenizer(cfg.model))
    assert err.value.problems[0].endswith('the template layout differs: answer_open: "" when prepared, "<x>" now')
    assert len(err.value.problems) == 2  # that, and what to do: the template text itself is the same


def test_a_matching_fingerprint_passes_and_the_diagnostics_read_the_saved_rows(prepared_project, tmp_path):
    cfg = load_config(prepared_project)
    tok = load_tokenizer(cfg.model)
    assert check_prepared(cfg, tok)[0] == Path(cfg.data.prepared_path)
    # same data and template: packing only matters to training, not to the diagnostics
    packed = load_config(prepared_project, ["train.packing=true"])
    with pytest.raises(ConfigError, match="packing settings differ"):
        check_prepared(packed, tok)
    from qlora_train.diagnostics.run import DebugOptions, diagnose

    raw_cfg = load_config(prepared_project, ["data.prepared_path=null"])
    kw = {"stats": True, "debug": DebugOptions(samples=3), "stream": io.StringIO()}
    from_raw = diagnose(raw_cfg, out_dir=tmp_path / "a", **kw)
    from_prepared = diagnose(packed, out_dir=tmp_path / "b", **kw)
    assert from_prepared["stats"] == from_raw["stats"]
    assert from_prepared["samples"] == from_raw["samples"] and len({s.index for s in from_raw["samples"]}) == 3


def test_a_missing_or_damaged_prepared_directory_is_exit_2(prepared_project, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(prepared_project.parent / "prepared", broken)
    run = lambda path: (main(["--config", str(prepared_project), "--set", f"data.prepared_path={path}"]),
                        capsys.readouterr().err)

    code, err = run(tmp_path / "absent")
    assert code == 2 and f"data.prepared_path: {tmp_path / 'absent'}: directory not found" in err
    for shard in (broken / "train").glob("*.arrow"):
        shard.write_bytes(b"not arrow")
    code, err = run(broken)
    assert code == 2 and f"data.prepared_path: {broken / 'train'} is not what --preprocess wrote" in err
    saved = json.loads((broken / FINGERPRINT_FILE).read_text())  # the hashes rewritten to match: still not read
    saved["shards"] |= shard_hashes(broken, ("train",))
    (broken / FINGERPRINT_FILE).write_text(json.dumps(saved))
    code, err = run(broken)
    assert code == 2 and f"data.prepared_path: {broken / 'train'} cannot be read" in err
    (broken / FINGERPRINT_FILE).write_text("{")
    code, err = run(broken)
    assert code == 2 and f"{FINGERPRINT_FILE} cannot be read" in err
    (broken / FINGERPRINT_FILE).unlink()
    code, err = run(broken)
    assert code == 2 and "not a directory written by --preprocess" in err


def test_data_prepared_before_renders_were_cut_at_their_turns_is_refused(prepared_project, tmp_path, capsys):
    # format 1: ids of the render tokenized whole (before issue 34); its labels miss answers' first tokens
    old = tmp_path / "old"
    shutil.copytree(prepared_project.parent / "prepared", old)
    saved = json.loads((old / FINGERPRINT_FILE).read_text())
    assert saved["format"] == 3
    for earlier in ({**saved, "format": 1}, {k: v for k, v in saved.items() if k != "shards"} | {"format": 2}):
        (old / FINGERPRINT_FILE).write_text(json.dumps(earlier))
        code = main(["--config", str(prepared_project), "--set", f"data.prepared_path={old}"])
        assert code == 2 and f"{FINGERPRINT_FILE} is not of format 3; run --preprocess again" in capsys.readouterr().err


def tampered(prepared: Path, dest: Path, edit) -> Path:
    """A copy of ``prepared`` whose train/ rows were passed through ``edit`` (a row -> the row) and saved again
    (as someone editing the shards would)."""
    import datasets

    shutil.copytree(prepared, dest)
    rows = datasets.load_from_disk(str(prepared / "train")).map(edit)
    shutil.rmtree(dest / "train")
    rows.save_to_disk(str(dest / "train"))
    return dest


def test_prepared_shards_edited_since_are_refused_naming_them(prepared_project, tmp_path, capsys):
    """Labels all set to the ids (every prompt token trained): the fingerprint of the config still matches, the
    shards' hashes do not."""
    edited = tampered(prepared_project.parent / "prepared", tmp_path / "edited",
                      lambda row: {**row, "labels": row["input_ids"]})
    capsys.readouterr()
    code = main(["--config", str(prepared_project), "--set", f"data.prepared_path={edited}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("invalid config:\n")
    assert f"data.prepared_path: {edited / 'train'}/data-00000-of-00001.arrow: changed since --preprocess wrote it" \
        in err
    assert f"data.prepared_path: {edited / 'train'} is not what --preprocess wrote" in err


def test_tokens_outside_the_vocabulary_are_one_line_before_the_model_loads(prepared_project, tmp_path, capsys):
    """Shards edited and their hashes rewritten to match: the rows themselves are checked, the first bad one
    named."""
    edited = tampered(prepared_project.parent / "prepared", tmp_path / "oov",
                      lambda row: {**row, "input_ids": [10 ** 6, *row["input_ids"][1:]]})
    saved = json.loads((edited / FINGERPRINT_FILE).read_text())
    saved["shards"] |= shard_hashes(edited, ("train",))
    (edited / FINGERPRINT_FILE).write_text(json.dumps(saved))
    cfg = load_config(prepared_project, [f"data.prepared_path={edited}"])
    tok = load_tokenizer(cfg.model)
    with pytest.raises(ConfigError) as err:
        training_data(cfg, tok)
    assert err.value.problems == [
        f"data.prepared_path: {edited / 'train'} row 0, position 0: id 1000000 is outside the vocabulary of "
        f"{len(tok):,} tokens: not what --preprocess makes with this tokenizer; run --preprocess again"]
    capsys.readouterr()
    assert main(["--config", str(prepared_project), "--set", f"data.prepared_path={edited}"]) == 2
    assert capsys.readouterr().err.splitlines() == ["invalid config:", f"  {err.value.problems[0]}"]


def test_preprocess_refuses_to_replace_a_directory_that_is_not_prepared_data(prepared_project, tmp_path, capsys):
    other = tmp_path / "results"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["--config", str(prepared_project), "--preprocess", "--preprocess-dir", str(other)]) == 2
    assert "is a non-empty directory without fingerprint.json" in capsys.readouterr().err
    assert (other / "keep.txt").read_text() == "mine"


def test_preprocess_dir_needs_preprocess(prepared_project, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(prepared_project), "--preprocess-dir", "x"])
    assert stop.value.code == 2 and "--preprocess-dir needs --preprocess" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", str(prepared_project), "--preprocess", "--stats-only"])


def test_two_processes_write_the_same_prepared_data_as_one(tmp_path, model_dir):
    """data.num_proc: 2 (each run with a fresh datasets cache) -> the same datasets, report and fingerprint."""
    made = []
    for n in (1, 2):
        cfg = load_config(write_project(tmp_path, model_dir, data={
            "num_proc": n, "cache_dir": str(tmp_path / f"cache-{n}")}, name=f"cfg{n}.yaml"))
        tok = load_tokenizer(cfg.model)
        write_prepared(cfg, tok, tmp_path / f"p{n}")
        made.append(training_data(cfg.model_copy(update={"data": cfg.data.model_copy(
            update={"prepared_path": str(tmp_path / f"p{n}")})}), tok))
    assert_same_training_data(*made)
    import datasets

    for sub in ("rows/raw", "rows/processed"):
        assert columns(datasets.load_from_disk(str(tmp_path / "p1" / sub))) == columns(
            datasets.load_from_disk(str(tmp_path / "p2" / sub)))
    fp = [json.loads((tmp_path / f"p{n}" / FINGERPRINT_FILE).read_text())["fingerprint"] for n in (1, 2)]
    assert fp[0] == fp[1]


def test_preprocess_loads_neither_the_model_nor_peft_bitsandbytes_or_the_trainer(prepared_project, tmp_path):
    code = ("import sys\nfrom qlora_train.config import load_config\nfrom qlora_train.train.preprocess import "
            f"preprocess\npreprocess(load_config({str(prepared_project)!r}), {str(tmp_path / 'p')!r})\n"
            "print(sorted(m for m in ('peft', 'bitsandbytes', 'transformers.trainer', 'qlora_train.train.run', "
            "'qlora_train.train.model') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "prepared data written to" in out.stdout
