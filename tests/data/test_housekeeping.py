"""Filters and housekeeping: dedup, length filters, shuffle, eval sources, domains, cache reuse, row handlers."""

from __future__ import annotations

import json

import pytest

from qlora_train.config import ConfigError, DataConfig, DatasetSource, RowHandlerSpec
from qlora_train.data.dataset import build_datasets, process_dataset
from qlora_train.data.handlers import register_row_handler
from qlora_train.data.sources import load_labelled_source, load_source


def jsonl(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def qa(i, **extra):
    return {"prompt": f"question {i}", "response": f"answer {i}", **extra}


def test_dedup_counts_exact_duplicates_across_schemas_and_sources(tmp_path, qwen3_tok):
    same_as_qa1 = {"messages": [{"role": "user", "content": "question 1"},
                                {"role": "assistant", "content": "answer 1"}]}
    a = jsonl(tmp_path, "a.jsonl", [qa(0), qa(1), qa(0)])
    b = jsonl(tmp_path, "b.jsonl", [same_as_qa1, qa(2)])
    cfg = DataConfig(datasets=[DatasetSource(path=a), DatasetSource(path=b)], dedup=True)
    train, _, report = build_datasets(cfg, qwen3_tok)
    assert len(train) == 3 and report.duplicates == 2 and report.dropped == {"duplicate": 2}
    assert report.first_dropped["duplicate"] == f"{a}:3: same content as {a}:1"
    _, _, report = build_datasets(cfg.model_copy(update={"dedup": False}), qwen3_tok)
    assert report.rows_kept == 5 and report.duplicates == 0


def test_min_and_max_chars(tmp_path, qwen3_tok):
    rows = [{"prompt": "q", "response": "a"}, {"prompt": "qq", "response": "aaaa"},
            {"prompt": "q" * 10, "response": "a"}]
    cfg = DataConfig(datasets=[DatasetSource(path=jsonl(tmp_path, "d.jsonl", rows))], min_chars=3, max_chars=8)
    _, _, report = build_datasets(cfg, qwen3_tok)  # content chars: 2, 6, 11
    assert report.rows_kept == 1 and report.dropped == {"filtered_by_length": 2}
    with pytest.raises(ValueError, match="max_chars: must be at least min_chars"):
        DataConfig(min_chars=5, max_chars=4)


def test_shuffle_is_seeded(tmp_path, qwen3_tok):
    src = DatasetSource(path=jsonl(tmp_path, "d.jsonl", [qa(i) for i in range(20)]))
    plain = build_datasets(DataConfig(datasets=[src]), qwen3_tok)[0]["input_ids"]
    runs = [build_datasets(DataConfig(datasets=[src], shuffle=True, shuffle_seed=s), qwen3_tok)[0]["input_ids"]
            for s in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2] and runs[0] != plain and sorted(runs[0]) == sorted(plain)


def test_separate_eval_datasets(tmp_path, qwen3_tok):
    train_src = DatasetSource(path=jsonl(tmp_path, "t.jsonl", [qa(i) for i in range(4)]))
    eval_src = DatasetSource(path=jsonl(tmp_path, "e.jsonl", [qa(10), {"foo": 1}]))
    train, eval_ds, report = build_datasets(DataConfig(datasets=[train_src], eval_datasets=[eval_src]), qwen3_tok)
    assert (len(train), len(eval_ds), report.eval_rows) == (4, 1, 1)
    assert report.eval_dropped == {"unknown_schema": 1} and report.rows_in == 4
    assert "question 10" in qwen3_tok.decode(eval_ds[0]["input_ids"])


def test_domain_stats(tmp_path, qwen3_tok):
    rows = [qa(0, topic="math"), qa(1, topic="math"), qa(2, topic="code"), qa(3)]
    cfg = DataConfig(datasets=[DatasetSource(path=jsonl(tmp_path, "d.jsonl", rows))], domain_key="topic")
    train, _, report = build_datasets(cfg, qwen3_tok)
    assert {d: s["rows"] for d, s in report.domains.items()} == {"math": 2, "code": 1, "": 1}
    assert sum(s["tokens"] for s in report.domains.values()) == report.tokens == sum(map(len, train["input_ids"]))


def test_cache_is_reused_until_an_option_or_the_template_changes(tmp_path, qwen3_tok, family_tokenizers):
    path = jsonl(tmp_path, "d.jsonl", [qa(i) for i in range(3)])
    cache = str(tmp_path / "cache")
    cfg = DataConfig(datasets=[DatasetSource(path=path)], cache_dir=cache)
    raw = load_labelled_source(0, cfg.datasets[0], cache_dir=cache)
    first = process_dataset(raw, qwen3_tok, cfg)
    again = process_dataset(load_labelled_source(0, cfg.datasets[0], cache_dir=cache), qwen3_tok, cfg)
    assert again._fingerprint == first._fingerprint
    assert [f["filename"] for f in again.cache_files] == [f["filename"] for f in first.cache_files]
    changed = {
        "option": process_dataset(raw, qwen3_tok, cfg.model_copy(update={"think_loss": "answer_only"}))._fingerprint,
        "mask": process_dataset(raw, qwen3_tok, cfg.model_copy(update={"train_on_eos": "none"}))._fingerprint,
        "template": process_dataset(raw, family_tokenizers["chatml"], cfg)._fingerprint,
    }
    assert first._fingerprint not in changed.values() and len(set(changed.values())) == 3
    # another source, weights or mixing do not touch this source's processing (DataConfig.for_source)
    other = cfg.model_copy(update={"datasets": [DatasetSource(path=path, weight=2), DatasetSource(path="x", weight=1)]})
    assert (process_dataset(raw, qwen3_tok, cfg.for_source(cfg.datasets[0]))._fingerprint
            == process_dataset(raw, qwen3_tok, other.for_source(other.datasets[0]))._fingerprint)


def test_max_samples_per_source_and_overall(tmp_path, qwen3_tok):
    path = jsonl(tmp_path, "d.jsonl", [qa(i) for i in range(6)])
    src = DatasetSource.model_validate({"path": path, "max_items": 4})
    train, _, report = build_datasets(DataConfig(datasets=[src]), qwen3_tok)
    assert report.rows_in == 4 == len(train)
    train, _, report = build_datasets(DataConfig(datasets=[src], max_samples=3), qwen3_tok)
    assert report.rows_in == 4 and report.train_rows == 3 == len(train)


@register_row_handler("test_rename_qa")
def rename_qa(row, *, prefix=""):
    return {"prompt": prefix + row["q"], "response": row["a"]}


@register_row_handler("test_split_pairs")
def split_pairs(columns):
    """Batched: each row holds two exchanges; emit one row per exchange."""
    out = {"prompt": [], "response": []}
    for pair in columns["pairs"]:
        for p, r in pair:
            out["prompt"].append(p)
            out["response"].append(r)
    return out


def test_row_handler_by_name_with_kwargs_and_remove_columns(tmp_path, qwen3_tok):
    path = jsonl(tmp_path, "d.jsonl", [{"q": "x", "a": "y"}])
    spec = RowHandlerSpec(name="test_rename_qa", fn_kwargs={"prefix": "Q: "}, remove_columns=["q", "a"])
    raw = load_source(DatasetSource(path=path, handlers=[spec]))
    assert [json.loads(r) for r in raw["row"]] == [{"prompt": "Q: x", "response": "y"}]
    assert raw["location"] == [f"{path}:1"]


def test_batched_row_handler_may_change_the_row_count(tmp_path, qwen3_tok):
    path = jsonl(tmp_path, "d.jsonl", [{"pairs": [["a", "b"], ["c", "d"]]}, {"pairs": [["e", "f"]]}])
    src = DatasetSource.model_validate({"path": path, "handlers": [{"name": "test_split_pairs", "batched": True}]})
    train, _, report = build_datasets(DataConfig(datasets=[src]), qwen3_tok)
    assert report.rows_kept == 3 == len(train)


def test_unknown_row_handler_names_the_fix(tmp_path):
    path = jsonl(tmp_path, "d.jsonl", [qa(0)])
    with pytest.raises(ConfigError, match="row handler 'nope' is not registered .*data.handler_modules"):
        load_source(DatasetSource(path=path, handlers=[RowHandlerSpec(name="nope")]))


def _small_bpe(chat_template: str):
    """A byte-level BPE of a few hundred tokens trained here (a real vocabulary's JSON takes seconds to copy)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?\p{L}+| ?\p{N}|\s+"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False)
    backend.train_from_iterator([f"question {i}: what is the answer to number {i}?" for i in range(50)], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tok.chat_template = chat_template
    return tok


def test_the_maps_cache_key_follows_the_tokenizer(tmp_path, qwen3_tok):
    """The map's key (identity.map_fingerprint, given to datasets) changes with the tokenizer's merges, vocabulary,
    BPE settings, pre-tokenizer, added tokens, special tokens, template and Python-side settings; not with its
    truncation or padding, nor a copy of the same tokenizer."""
    import copy
    import json

    from tokenizers import Tokenizer

    from qlora_train.data import identity
    from qlora_train.data.identity import map_fingerprint

    path = jsonl(tmp_path, "d.jsonl", [qa(i) for i in range(2)])
    cfg = DataConfig(datasets=[DatasetSource(path=path)], cache_dir=str(tmp_path / "cache"))
    small = _small_bpe(qwen3_tok.chat_template)
    key = map_fingerprint("raw", small, cfg, "code")
    base = json.loads(small._tokenizer.to_str())

    def fresh():  # a copy of ``small`` with its own pipeline, from its JSON
        tok = copy.copy(small)
        tok.__dict__.update(copy.deepcopy({k: v for k, v in vars(small).items() if k != "_tokenizer"}))
        return tok

    def changed(edit_spec=None, edit_tok=None):
        tok = fresh()
        spec = copy.deepcopy(base)
        if edit_spec:
            edit_spec(spec)
        tok._tokenizer = Tokenizer.from_str(json.dumps(spec))
        if edit_tok:
            edit_tok(tok)
        return map_fingerprint("raw", tok, cfg, "code")

    def swap_merges(spec):
        merges = spec["model"]["merges"]
        merges[0], merges[1] = merges[1], merges[0]

    def swap_ids(spec):
        vocab = spec["model"]["vocab"]
        a, b = list(vocab)[260:262]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    keys = {
        "merges": changed(swap_merges),
        "vocab": changed(swap_ids),
        "a BPE setting": changed(lambda s: s["model"].update(ignore_merges=not s["model"].get("ignore_merges"))),
        "pre_tokenizer": changed(lambda s: s["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\s+")),
        "added token": changed(edit_tok=lambda t: t.add_tokens(["<zzz>"])),
        "special token": changed(edit_tok=lambda t: t.add_special_tokens({"pad_token": "<|im_start|>"})),
        "template": changed(edit_tok=lambda t: setattr(t, "chat_template", t.chat_template + " ")),
        "python side": changed(edit_tok=lambda t: setattr(t, "model_max_length", 17)),
        "raw rows": map_fingerprint("raw2", small, cfg, "code"),
        "config": map_fingerprint("raw", small, cfg.model_copy(update={"train_on_eos": "none"}), "code"),
        "code": map_fingerprint("raw", small, cfg, "code2"),
    }
    assert key not in keys.values() and len(set(keys.values())) == len(keys), keys
    assert identity._bpe_settings(small._tokenizer.model) is not None  # its saved files hashed, not its JSON
    same = fresh()
    same._tokenizer = Tokenizer.from_str(json.dumps(base))
    same._tokenizer.enable_truncation(8)
    same._tokenizer.enable_padding()
    assert map_fingerprint("raw", same, cfg, "code") == key == map_fingerprint("raw", small, cfg, "code")


def test_gc_frozen_nests_and_unfreezes_at_the_outermost_end():
    """``gc_frozen`` blocks nest: an inner block's end leaves the outer's objects frozen, the outer's end unfreezes
    them all."""
    import gc

    from qlora_train.data.dataset import gc_frozen

    assert gc.get_freeze_count() == 0
    with gc_frozen():
        outer = gc.get_freeze_count()
        with gc_frozen():
            assert gc.get_freeze_count() >= outer > 0
        assert gc.get_freeze_count() >= outer
    assert gc.get_freeze_count() == 0
