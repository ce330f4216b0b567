"""load_tokenizer: the class tokenizer_config.json names, loaded without importing torch, equal to AutoTokenizer's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qlora_train.tokenizer import tokenizer_class

# saves and reloads tokenizers of several classes: make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TEXT = "user: 2+2? <think>add</think> 4<|im_end|>\n naïve 東京 \t done"


def test_the_named_class_is_the_one_auto_tokenizer_picks_and_encodes_the_same(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    direct = tokenizer_class(str(qwen_tokenizer_dir)).from_pretrained(qwen_tokenizer_dir)
    assert type(direct) is type(auto) and len(direct) == len(auto)
    assert direct(TEXT, return_offsets_mapping=True) == auto(TEXT, return_offsets_mapping=True)
    assert direct.special_tokens_map == auto.special_tokens_map


@pytest.mark.parametrize("config, expected", [
    ({"tokenizer_class": "NoSuchTokenizer"}, "AutoTokenizer"),
    ({"tokenizer_class": "TokenizersBackend", "auto_map": {"AutoTokenizer": ["x.Tok", None]}}, "AutoTokenizer"),
    ({"tokenizer_class": "PreTrainedConfig"}, "AutoTokenizer"),  # a transformers class that is no tokenizer
    ({"tokenizer_class": "TokenizersBackend"}, "TokenizersBackend"),
])
def test_auto_tokenizer_is_the_fallback(tmp_path, config, expected):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_class(str(tmp_path)).__name__ == expected
    assert tokenizer_class(str(tmp_path), trust_remote_code=True).__name__ == "AutoTokenizer"
    assert tokenizer_class("Qwen/Qwen3-1.7B").__name__ == "AutoTokenizer"  # a hub id


def test_loading_a_local_tokenizer_imports_no_torch(qwen_tokenizer_dir):
    probe = ("import sys\nfrom qlora_train.config import ModelConfig\n"
             "from qlora_train.tokenizer import load_tokenizer\n"
             f"tok = load_tokenizer(ModelConfig(name_or_path={str(qwen_tokenizer_dir)!r}, chat_template='qwen3'))\n"
             "print(type(tok).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["TokenizersBackend", "False"]


def test_the_tiny_tokenizer_is_saved_as_real_qwen_repositories_ship_it(tmp_path):
    """added_tokens_decoder in tokenizer_config.json (transformers then need not re-read tokenizer.json in
    Python); the tokenizer loads back the same."""
    from transformers import AutoTokenizer

    from qlora_train.tiny import build_qwen_tokenizer, save_tokenizer

    tok = build_qwen_tokenizer("qwen3")
    save_tokenizer(tok, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]["151645"]["content"] == "<|im_end|>"
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.added_tokens_decoder == tok.added_tokens_decoder and loaded(TEXT) == tok(TEXT)


# --- model.new_tokens: the template's markers as tokens -------------------------------------------------------------

@pytest.mark.parametrize("text, markers", [
    ("<|im_start|>assistant\n", ["<|im_start|>"]),
    ("<|start_header_id|>assistant<|end_header_id|>\n\n", ["<|start_header_id|>", "<|end_header_id|>"]),
    ("question<|eot_id|><|start_header_id|>", ["<|eot_id|>", "<|start_header_id|>"]),  # probe text glued on
    ("<start_of_turn>model\n", ["<start_of_turn>"]),
    ("<think>\n", ["<think>"]),
    ("</think>\n\n", ["</think>"]),
    ("<｜Assistant｜>", ["<｜Assistant｜>"]),
    ("[/INST]", ["[/INST]"]),
    (" [INST] ", ["[INST]"]),
    ("<<SYS>>\n", ["<<SYS>>"]),
    ("<|o|>message role=\"assistant\"<|s|>", ["<|o|>", "<|s|>"]),
    ("\n### Response:\n", []),  # no bracketed marker: stays text
    ("Assistant: ", []),
    ("a < b > c [x y]", []),  # whitespace inside: not a marker
    ("", []),
])
def test_markers_are_the_bracketed_runs_of_template_text(text, markers):
    from qlora_train.tokenizer import marker_pieces

    assert marker_pieces(text) == markers


def foreign_cfg(tokenizer_dir, template, new_tokens=None):
    from qlora_train.config import ModelConfig

    return ModelConfig(name_or_path=str(tokenizer_dir), chat_template=str(template), new_tokens=new_tokens)


@pytest.fixture(scope="module")
def foreign_plain(qwen_tokenizer_dir, foreign_template):
    """The Qwen tokenizer with the foreign template, no new tokens: its markers are plain text."""
    from qlora_train.tokenizer import load_tokenizer

    return load_tokenizer(foreign_cfg(qwen_tokenizer_dir, foreign_template))


@pytest.fixture(scope="module")
def foreign_auto(qwen_tokenizer_dir, foreign_template):
    """(tokenizer, NewTokens) with ``model.new_tokens: auto``."""
    from qlora_train.tokenizer import load_tokenizer_with_new_tokens

    return load_tokenizer_with_new_tokens(foreign_cfg(qwen_tokenizer_dir, foreign_template, "auto"))


def test_the_markers_of_a_template_are_read_off_its_layout(qwen_tokenizer_dir, foreign_plain):
    from qlora_train.config import ModelConfig
    from qlora_train.tokenizer import load_tokenizer, template_markers

    assert template_markers(foreign_plain) == ["<|turn_open|>", "<think>", "</think>", "<|turn_close|>"]
    gemma = load_tokenizer(ModelConfig(name_or_path=str(qwen_tokenizer_dir), chat_template="gemma"))
    # no reasoning tags (it writes none); <bos>: Qwen's vocabulary has no BOS token, so the template writes it as text
    assert template_markers(gemma) == ["<bos>", "<start_of_turn>", "<end_of_turn>"]


def test_auto_adds_the_markers_that_are_not_single_tokens(foreign_plain, foreign_auto):
    from qlora_train.masking import template_layout

    base, (tok, new) = foreign_plain, foreign_auto
    assert new.tokens == ("<|turn_open|>", "<|turn_close|>")  # <think> and </think> are Qwen tokens already
    assert new.ids == (len(base), len(base) + 1) and len(tok) == len(base) + 2
    assert new.pieces == tuple(tuple(base.encode(t, add_special_tokens=False)) for t in new.tokens)
    assert all(len(p) == 6 for p in new.pieces)
    for token, i in zip(new.tokens, new.ids):
        assert tok.encode(token, add_special_tokens=False) == [i]
        assert tok.added_tokens_decoder[i].special
    text = tok.apply_chat_template([{"role": "user", "content": "hi<|turn_close|>x"}], tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == new.ids[0] and ids.count(new.ids[1]) == 2  # never merged with the text beside them
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhix\n"
    assert template_layout(tok).end_markers == ("<|turn_close|>",)  # probed again with the tokens


def test_listed_new_tokens_skip_what_is_one_token_already(qwen_tokenizer_dir, foreign_template):
    from qlora_train.tokenizer import load_tokenizer_with_new_tokens

    tok, new = load_tokenizer_with_new_tokens(foreign_cfg(qwen_tokenizer_dir, foreign_template,
                                                          ["<think>", "<|turn_close|>"]))
    assert new.tokens == ("<|turn_close|>",) and new.already == ("<think>",) and new
    assert len(tok.encode("<|turn_open|>", add_special_tokens=False)) == 6  # not listed: still text


def test_labels_use_the_new_ids(foreign_auto):
    from qlora_train.data import DataConfig, process_rows
    from qlora_train.masking.tokenize import IGNORE_INDEX

    tok, new = foreign_auto
    opener, closer = new.ids
    row = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello!"},
                        {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Hi!"}]}
    out = process_rows([row], tok, DataConfig())
    assert not out["drop_reason"][0]
    ids, labels = out["input_ids"][0], out["labels"][0]
    trained = [i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX]
    assert trained == tok.encode("Hello!", add_special_tokens=False) + [closer] + \
        tok.encode("Hi!", add_special_tokens=False) + [closer]
    assert ids.count(opener) == 4 and ids.count(closer) == 4


def test_the_saved_tokenizer_keeps_the_new_tokens(foreign_auto, tmp_path):
    from transformers import AutoTokenizer

    tok, new = foreign_auto
    tok.save_pretrained(tmp_path)
    saved = AutoTokenizer.from_pretrained(tmp_path)
    assert len(saved) == len(tok) and [saved.convert_tokens_to_ids(t) for t in new.tokens] == list(new.ids)
    assert all(saved.added_tokens_decoder[i].special for i in new.ids)


# --- a template that needs a special token the tokenizer does not define ---------------------------------------------

BOS_TEMPLATE = ("{{ bos_token + '' }}{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
                "'<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_template_needing_a_bos_token_the_tokenizer_lacks_is_said_once_at_load(tmp_path, qwen_tokenizer_dir,
                                                                                 capsys):
    """Issue 34: on a vocabulary without a BOS token (Qwen's), a template that concatenates ``bos_token`` raised
    ``UndefinedError`` on every row, each refused one by one; now loading the tokenizer says it once, with what to
    set (exit 2), and setting it as a template kwarg renders."""
    import yaml

    from qlora_train.cli import main
    from qlora_train.config import ModelConfig
    from qlora_train.errors import ConfigError
    from qlora_train.tokenizer import load_tokenizer

    template = tmp_path / "needs-bos.jinja"
    template.write_text(BOS_TEMPLATE)
    with pytest.raises(ConfigError) as err:
        load_tokenizer(ModelConfig(name_or_path=str(qwen_tokenizer_dir), chat_template=str(template)))
    assert err.value.exit_code == 2
    (problem,) = err.value.problems
    assert problem.startswith("model.chat_template: the chat template uses bos_token, which the tokenizer ")
    assert "('bos_token' is undefined)" in problem and 'model.chat_template_kwargs: {bos_token: "..."}' in problem

    tok = load_tokenizer(ModelConfig(name_or_path=str(qwen_tokenizer_dir), chat_template=str(template),
                                     chat_template_kwargs={"bos_token": ""}))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n")

    tree = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())  # through the CLI: one message, exit 2
    tree["model"].update(name_or_path=str(qwen_tokenizer_dir), chat_template=str(template))
    tree["data"]["datasets"][0]["path"] = str(REPO / "configs/data/quickstart.jsonl")
    tree["train"]["output_dir"] = str(tmp_path / "out")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tree))
    assert main(["--config", str(tmp_path / "c.yaml"), "--stats-only", "--stats-dir", str(tmp_path / "s")]) == 2
    printed = capsys.readouterr()
    assert (printed.out + printed.err).count("'bos_token' is undefined") == 1


def test_a_template_that_writes_bos_only_where_defined_loads(tmp_path, qwen_tokenizer_dir):
    """No false alarm: ``{{ bos_token }}`` alone renders nothing when undefined, and a template's own errors on
    the probe rows (roles it refuses) are left to the probe and the rows."""
    from qlora_train.config import ModelConfig
    from qlora_train.tokenizer import load_tokenizer

    for i, source in enumerate(("{{ bos_token }}" + BOS_TEMPLATE.split("}}", 1)[1],
                                "{{ raise_exception('no assistant turns here') }}")):
        template = tmp_path / f"t{i}.jinja"
        template.write_text(source)
        load_tokenizer(ModelConfig(name_or_path=str(qwen_tokenizer_dir), chat_template=str(template)))
