"""Chat templates shipped with qlora-train, and choosing one for a tokenizer.

Each ``templates/<name>.jinja`` is written by us to reproduce the documented
turn layout of one model family. ``get_chat_template`` sets one on a tokenizer.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent / "templates"
ALIASES = {"qwen2": "qwen2.5", "qwen3_5": "qwen3.5", "llama3.1": "llama3", "gemma2": "gemma", "gemma3": "gemma"}


def shipped_templates() -> list[str]:
    """Names accepted by ``get_chat_template`` besides ``tokenizer`` and paths."""
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))


@cache
def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def resolve_chat_template(chat_template: str) -> str | None:
    """Name / path -> template source; ``"tokenizer"`` -> None (keep the tokenizer's own)."""
    if chat_template == "tokenizer":
        return None
    name = ALIASES.get(chat_template, chat_template)
    shipped = TEMPLATE_DIR / f"{name}.jinja"
    if shipped.is_file():
        return _read(shipped)
    path = Path(chat_template)
    if path.suffix == ".jinja":
        if not path.is_file():
            raise FileNotFoundError(f"chat_template file not found: {path}")
        return _read(path)
    raise ValueError(
        f"unknown chat_template {chat_template!r}: use one of {shipped_templates()}, 'tokenizer', or a .jinja path"
    )


def get_chat_template(tokenizer, chat_template: str = "qwen3"):
    """Set the chosen template on ``tokenizer`` (in place) and return it.

    >>> tok = get_chat_template(tok, "qwen3")   # shipped template
    >>> tok = get_chat_template(tok, "tokenizer")  # keep the tokenizer's own
    """
    source = resolve_chat_template(chat_template)
    if source is None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat_template: tokenizer was asked for, but the tokenizer has no chat template")
        return tokenizer
    tokenizer.chat_template = source
    return tokenizer
