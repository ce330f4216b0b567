"""Text from rows and templates as shown on a terminal: control characters escaped.

A row's text may hold terminal control sequences (``ESC ] 0 ; title BEL`` retitles the terminal,
``ESC [ 2 J`` clears it) or bidirectional overrides that reorder what is shown. Everything that prints
row or template text (``--debug-samples``, ``--stats-only``, log lines, error messages) shows it through
``visible``: C0 controls other than newline and tab, DEL, C1 controls, the bidirectional controls and
lone surrogates (which no terminal encoding can write) become Python-style escapes; all else is kept.

    >>> visible("hi\\x1b]0;owned\\x07\\x1b[2J\\tthere\\n\\u202eevil")
    'hi\\\\x1b]0;owned\\\\x07\\\\x1b[2J\\tthere\\n\\\\u202eevil'
"""

from __future__ import annotations

import logging
import re

# C0 but \t and \n; DEL and C1; ALM, LRM, RLM, the embeddings/overrides (U+202A-E) and isolates (U+2066-9);
# surrogates
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    """A character -> its escape as ``repr`` writes it: ``\\r``, ``\\x1b``, ``\\u202e``."""
    char = match.group()
    if char == "\r":
        return "\\r"
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` with every character that could drive or reorder a terminal written as its escape."""
    return _CONTROL.sub(_escape, text)


class VisibleFormatter(logging.Formatter):
    """A log formatter whose lines (message, arguments and traceback) are shown through ``visible``."""

    def format(self, record: logging.LogRecord) -> str:
        return visible(super().format(record))
