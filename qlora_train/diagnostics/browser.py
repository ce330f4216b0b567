"""Check ``debug_samples.html`` in headless Chromium: it loads, shows every token, and renders.

    python -m qlora_train.diagnostics.browser outputs/run/debug_samples.html --screenshot page.png

Chromium parses the page and dumps its DOM; every sample section and every
token span (text, trained or not, hover title) must come back exactly as
written, and the screenshot must not be blank. Needs a ``chromium`` binary
(Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from qlora_train.diagnostics.html import read_tokens

BINARIES = ("chromium", "chromium-browser", "google-chrome", "headless_shell")


def chromium_binary() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


def _chromium(binary: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def _blank(png: Path) -> bool:
    from PIL import Image

    with Image.open(png) as img:
        return all(lo == hi for lo, hi in img.convert("RGB").getextrema())


def check_page(page: Path, screenshot: Path, *, binary: str | None = None, size: str = "1280,1600") -> list[str]:
    """Problems found (empty when the page is complete and renders)."""
    binary = binary or chromium_binary()
    if binary is None:
        return ["no chromium binary found (apt-get install chromium)"]
    url = page.resolve().as_uri()
    dom = _chromium(binary, "--dump-dom", url)
    if dom.returncode != 0:
        return [f"chromium --dump-dom failed ({dom.returncode}): {dom.stderr.strip()[-500:]}"]
    written, shown = read_tokens(page.read_text(encoding="utf-8")), read_tokens(dom.stdout)
    problems = []
    if list(written) != list(shown):
        problems.append(f"sections written {list(written)} but the browser shows {list(shown)}")
    for section, tokens in written.items():
        if shown.get(section) != tokens:
            got = shown.get(section, [])
            problems.append(f"{section}: {len(tokens)} token spans written, {len(got)} shown, or their text differs")
    shot = _chromium(binary, f"--screenshot={screenshot.resolve()}", f"--window-size={size}", url)
    if shot.returncode != 0 or not screenshot.is_file():
        problems.append(f"no screenshot ({shot.returncode}): {shot.stderr.strip()[-500:]}")
    elif _blank(screenshot):
        problems.append(f"{screenshot} is blank")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("page", type=Path)
    p.add_argument("--screenshot", type=Path, help="PNG to write (default: beside the page)")
    args = p.parse_args(argv)
    screenshot = args.screenshot or args.page.with_suffix(".png")
    problems = check_page(args.page, screenshot)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    if not problems:
        print(f"ok: every section and token span of {args.page} is shown; screenshot {screenshot}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
