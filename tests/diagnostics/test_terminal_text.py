"""Row and template text on the terminal (and the debug page): control characters shown escaped, never run.

On main, ``--debug-samples`` printed a kept row's text as it is: ``ESC ] 0 ; … BEL ESC [ 2 J`` retitled and cleared
the user's terminal."""

from __future__ import annotations

import json
import logging
import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from qlora_train.diagnostics import samples as S
from qlora_train.diagnostics.html import debug_html, read_tokens
from qlora_train.terminal import VisibleFormatter, visible

ATTACK = "\x1b]0;owned\x07\x1b[2J"  # retitle, then clear the screen
SHOWN = "\\x1b]0;owned\\x07\\x1b[2J"
# what a terminal may act on: C0 but \t and \n, DEL, C1, the bidirectional controls, lone surrogates
ACTIVE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


@pytest.mark.parametrize("text, shown", [
    (ATTACK, SHOWN),
    ("a\tb\nc", "a\tb\nc"),  # layout characters kept
    ("\r\x00\x7f\x85\x9b", "\\r\\x00\\x7f\\x85\\x9b"),  # CR, NUL, DEL, C1 NEL and CSI
    ("abc\u202edef\u2066\u200f", "abc\\u202edef\\u2066\\u200f"),  # bidirectional override, isolate, mark
    ("a\udcffb", "a\\udcffb"),  # a lone surrogate (an undecodable byte): no encoding can write it
    ("héllo ⟦ok⟧ 日本 \u00a0 🙂", "héllo ⟦ok⟧ 日本 \u00a0 🙂"),  # everything printable as it is
])
def test_visible(text, shown):
    assert visible(text) == shown


@given(st.text())
@example(ATTACK + "\u202e\udcff")
def test_visible_leaves_nothing_a_terminal_acts_on_and_keeps_the_rest(text):
    shown = visible(text)
    assert not ACTIVE.search(shown)
    shown.encode("utf-8")  # printable on any UTF-8 terminal
    assert shown == ACTIVE.sub(lambda m: repr(m.group())[1:-1], text)  # each as repr writes it; the rest as is


def sample(pieces: list[str], trained: list[bool], **kw) -> S.Sample:
    return S.Sample(index=0, location="d.jsonl:1", source="0:d.jsonl", input_ids=list(range(len(pieces))),
                    labels=[i if t else -100 for i, t in enumerate(trained)], pieces=pieces,
                    num_tokens_before=len(pieces), truncation="none", **kw)


def test_debug_samples_show_control_characters_escaped_keeping_the_marks():
    s = sample(["user: hi" + ATTACK, "\n", "ok\u202e", ATTACK, "<|im_end|>"], [False, False, True, True, True])
    assert S.format_sample(s, color=False).splitlines()[2:] == [
        f"user: hi{SHOWN}", f"{S.OPEN}ok\\u202e{SHOWN}<|im_end|>{S.CLOSE}"]
    coloured = S.format_sample(s, color=True)
    assert coloured.splitlines()[2:] == [f"{S.GREY}user: hi{SHOWN}", f"{S.RESET}{S.GREEN}ok\\u202e{SHOWN}<|im_end|>"
                                                                     f"{S.RESET}"]
    assert re.findall("\x1b[^[]", coloured) == []  # the only escapes are our colours (ESC [ … m)


def test_a_refused_row_shows_its_detail_and_raw_row_escaped():
    s = sample([], [], drop_reason="template_error", drop_detail=f"d.jsonl:1: TemplateError: role {ATTACK}",
               raw=json.dumps({"messages": [{"role": ATTACK + "\u202e"}]}))
    printed = S.format_sample(s, color=False)
    assert not ACTIVE.search(printed)
    assert f"refused: template_error: d.jsonl:1: TemplateError: role {SHOWN}" in printed
    assert '"role": "\\u001b]0;owned\\u0007\\u001b[2J\\u202e"' in printed  # JSON escapes C0, visible the rest


def test_raw_preview_of_json_python_cannot_read_is_the_text():
    huge = '{"n": ' + "9" * 5000 + "}"
    more = len(huge) - S.RAW_PREVIEW_CHARS
    assert S.raw_preview(huge) == huge[:S.RAW_PREVIEW_CHARS] + f"\n… ({more} more characters)"


def test_the_debug_page_shows_them_escaped_too():
    page = debug_html([sample([ATTACK, "ok\u202e<b>"], [False, True]),
                       S.Sample(index=1, location="d.jsonl:2", source="0:d.jsonl", input_ids=[], labels=[], pieces=[],
                                num_tokens_before=0, truncation="none", drop_reason="bad_row",
                                drop_detail=f"x {ATTACK}", raw=f'"{ATTACK}"')])
    assert not ACTIVE.search(page)
    assert read_tokens(page)["row-0"] == [(False, "#0 id 0 label -100", SHOWN), (True, "#1 id 1 label 1",
                                                                                  "ok\\u202e<b>")]
    assert f"x {SHOWN}" in page


def test_log_lines_are_shown_escaped():
    record = logging.LogRecord("qlora_train.data.dataset", logging.WARNING, __file__, 1,
                               "dropped %d rows: %s (first: %s)", (1, "template_error", f"d.jsonl:1: {ATTACK}"), None)
    assert VisibleFormatter("%(levelname)s %(message)s").format(record) == \
        f"WARNING dropped 1 rows: template_error (first: d.jsonl:1: {SHOWN})"


def test_an_error_naming_a_row_is_printed_escaped(capsys):
    from qlora_train.cli import run_guarded
    from qlora_train.data.drops import BadRowError

    def job():
        raise BadRowError(f"bad row (template_error) at d.jsonl:1: {ATTACK}")

    assert run_guarded(None, job) == 1
    assert capsys.readouterr().err == f"error: bad row (template_error) at d.jsonl:1: {SHOWN}\n"
