"""debug_samples.html in headless Chromium: every section and token span comes back, the screenshot renders."""

from __future__ import annotations

import json

import pytest

from qlora_train.cli import main
from qlora_train.diagnostics.browser import check_page, chromium_binary
from qlora_train.diagnostics.html import read_tokens

from .test_diagnostics import NO_ANSWER, SIMPLE, write_config, write_data

# drives a headless browser: make test (CI) runs it, make test-fast does not
pytestmark = [pytest.mark.skipif(chromium_binary() is None, reason="no chromium (make browser installs it)"),
              pytest.mark.slow]


@pytest.fixture
def page(tmp_path, qwen_tokenizer_dir, monkeypatch):
    """A page with a short sample, a long one (about 3000 tokens of mixed text) and a refused row."""
    long = {"messages": [
        {"role": "user", "content": "Explain, at length. " + "Τα δεδομένα 数据 <data> & \"quotes\"\n" * 150},
        {"role": "assistant", "content": "def f(x):\n    return x * 2  # 🙂 龘\n" * 150}]}
    data = write_data(tmp_path, [json.dumps(SIMPLE), json.dumps(long), json.dumps(NO_ANSWER)])
    cfg = write_config(tmp_path, qwen_tokenizer_dir, [data], max_length=8192)
    out = tmp_path / "dbg"
    monkeypatch.setenv("NO_COLOR", "1")
    assert main(["--config", str(cfg), "--debug-samples", "2", "--stats-dir", str(out)]) == 0
    kept = (out / "debug_samples.html").read_text()
    assert main(["--config", str(cfg), "--debug-samples", "2", "--debug-refused", "--stats-dir", str(out)]) == 0
    refused = (out / "debug_samples.html").read_text()
    # one page with all three: the kept page plus the refused section
    section = refused[refused.index('<section class="refused"'):refused.index("</section>") + len("</section>")]
    path = tmp_path / "page.html"
    path.write_text(kept.replace("\n</body>", section + "\n</body>"))
    return path


def test_page_loads_complete_and_renders(page, tmp_path):
    tokens = read_tokens(page.read_text())
    assert list(tokens) == ["row-0", "row-1", "row-2"] and len(tokens["row-1"]) > 2500
    shot = tmp_path / "page.png"
    assert check_page(page, shot) == []
    assert shot.read_bytes().startswith(b"\x89PNG")


def test_check_catches_content_the_browser_does_not_show(page, tmp_path):
    # an unclosed <textarea> makes the browser read the rest of the page as plain text
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace("<h1>", "<textarea><h1>", 1))
    problems = check_page(broken, tmp_path / "broken.png")
    assert problems and problems[0].startswith("sections written ['row-0', 'row-1', 'row-2'] but the browser shows []")
