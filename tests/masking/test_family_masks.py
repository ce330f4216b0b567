"""Verified masks on the layouts of 20 model families (stand-in templates in family_templates/).

For every family: the mask of a fixed conversation equals the one written by hand
(``Family.example_turns``), through the whole pipeline down to tokens; and over
random conversations (system, multi-turn, reasoning, tool calls where the family
has them, unicode and whitespace edges): no user/system/tool character is ever
trained, every trained turn's content and end marker are trained, the prompt side
(openers) never is, a token starts where each trained turn begins (the render is
tokenized in pieces cut there) and is trained, and, where the template renders each
prefix the same way inside the whole conversation, the trained text equals an
independent oracle: what each turn adds after the render of the conversation before
it with the generation prompt.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qlora_train.data import DataConfig, process_rows
from qlora_train.masking import IGNORE_INDEX, RowRejected, template_layout
from qlora_train.masking.policy import LossPolicy
from qlora_train.masking.render import render_conversation
from tests.masking.families import FAMILIES, example_messages
from tests.masking.oracle import DECIDED, prefix_oracle, tokens, trained_text

# every family template on real vocabularies (a tokenizer per family and vocabulary): make test (CI) runs it,
# make test-fast does not
pytestmark = pytest.mark.slow

mark = LossPolicy().mark  # messages written by hand get their train flags as the parse stage gives them

NAMES = sorted(FAMILIES)


@pytest.fixture(scope="module")
def toks(family_vocab_tokenizer):
    return {name: family_vocab_tokenizer(name) for name in NAMES}


def trained_chars(r) -> str:
    return "".join(c for c, m in zip(r.text, r.char_mask) if m)


@pytest.mark.parametrize("name", NAMES)
def test_example_mask_by_hand(toks, name):
    tok, fam = toks[name], FAMILIES[name]
    msgs = example_messages(name)
    assert trained_chars(render_conversation(mark(msgs), tok)) == fam.example_trained
    out = process_rows([{"messages": msgs}], tok, DataConfig(max_length=4096))
    assert out["drop_reason"] == [""], out["drop_detail"]
    ids = [i for i, lab in zip(out["input_ids"][0], out["labels"][0]) if lab != IGNORE_INDEX]
    assert tok.decode(ids) == fam.example_trained
    # the render tokenized in pieces cut where each hand-written turn begins (as the prompt is at inference)
    text, cuts, at = tok.apply_chat_template(msgs, tokenize=False), [], 0
    for turn in fam.example_turns:
        at = text.index(turn, at)
        cuts.append(at)
        at += len(turn)
    assert out["input_ids"][0] == tokens(tok, text, cuts)[0]


@pytest.mark.parametrize("name", NAMES)
def test_end_markers_found_by_the_probe(toks, name):
    # each documented end is found; a turn ending in A<|x|><|y|> may be probed as <|y|> (the span ends there too)
    fam = FAMILIES[name]
    probed = template_layout(toks[name]).end_markers
    documented = fam.end_markers if fam.supports_tools else fam.end_markers[:1]  # a call turn's: with tools
    assert all(any(end.endswith(p) for p in probed) for end in documented), probed


# ------------------------------------------------------------------ properties over random conversations
# Assistant text is lower-case (plus neutral characters); user, system and tool text upper-case. So "no
# user/system/tool character is trained" == "no upper-case letter is trained" (no family marker has one
# outside special tokens, which are stripped before the check).
NEUTRAL = " \n0123456789.,!?-é中🙂"
lower = st.text(alphabet="abcdefghijklmnopqrstuvwxyz" + NEUTRAL, min_size=1, max_size=24)
upper = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ" + NEUTRAL, min_size=1, max_size=24).filter(
    lambda s: any(c.isupper() for c in s))
answer = lower.filter(lambda s: any(c.isalpha() for c in s.strip()))
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


def _call(k: int, as_string: bool) -> dict:
    args = {"a": k}
    return {"type": "function", "function": {  # in the parse stage's key order (Falcon3 writes the whole dict)
        "name": "add", "arguments": json.dumps(args) if as_string else args}, "id": f"call{k:05d}"}


# a tool-call turn with empty content gets no header in Falcon3's template, and DeepSeek R1's writes the
# <｜Assistant｜> header only before the first tool-call turn of a conversation: the layout cannot bound such a
# turn, the rule applied with prefix renders can (tested below); the random conversations include them
NO_VERIFIABLE_TOOL_CALLS: set[str] = set()
KNOWN_REFUSALS: dict = {}


@st.composite
def conversations(draw, fam, *, reasoning: bool, tools: bool):
    msgs = []
    if fam.supports_system and draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(upper)})
    for k in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(upper)})
        if tools and fam.supports_tools and fam.name not in NO_VERIFIABLE_TOOL_CALLS and draw(st.integers(0, 2)) == 0:
            call = {"role": "assistant", "content": "", "tool_calls": [_call(k, fam.tool_arguments_as_string)]}
            msgs += [call, {"role": "tool", "content": draw(upper), "tool_call_id": f"call{k:05d}"}]
        m = {"role": "assistant", "content": draw(answer)}
        if reasoning and draw(st.booleans()):
            m["reasoning_content"] = draw(answer)
        msgs.append(m)
    return msgs


def _specials_removed(text: str, tok, fam) -> str:
    for t in sorted([*tok.get_added_vocab(), *fam.plain_markers], key=len, reverse=True):
        text = text.replace(t, "")
    return text


def check_properties(tok, fam, msgs, *, tools) -> str | None:
    if fam.name in KNOWN_REFUSALS and KNOWN_REFUSALS[fam.name](msgs):
        with pytest.raises(RowRejected) as err:
            render_conversation(mark(msgs), tok, tools=tools)
        assert err.value.reason == "mask_unverified"
        return None
    r = render_conversation(mark(msgs), tok, tools=tools)
    assert r.text == tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    trained = trained_chars(r)
    layout = template_layout(tok)
    assert not any(c.isupper() for c in _specials_removed(trained, tok, fam)), trained  # no user/system/tool text
    assistants = [m for m in msgs if m["role"] == "assistant"]
    assert [t.index for t in r.turns] == [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    at = 0
    for m, turn in zip(assistants, r.turns):  # content, then the end marker, inside each turn's span
        span = r.text[turn.start:turn.end]
        if m["content"].strip():
            assert m["content"].strip() in span
            at = trained.index(m["content"].strip(), at)
        last = turn is r.turns[-1]
        if layout.end_markers and not (last and layout.last_turn_unmarked):
            assert any(span.endswith(e) for e in layout.end_markers), span
    if name_has_private_openers(fam):
        for opener in layout.turn_openers:  # the prompt side is never trained
            assert opener not in trained
    out = process_rows([{"messages": msgs, **({"tools": tools} if tools else {})}], tok,
                       DataConfig(max_length=8192, reasoning_history="drop"))
    assert out["drop_reason"] == [""], out["drop_detail"]
    decoded = tok.decode([i for i, lab in zip(out["input_ids"][0], out["labels"][0]) if lab != IGNORE_INDEX])
    assert "".join(decoded.split()) == "".join(trained.split())  # tokens: exact up to boundary whitespace
    # the ids: the render cut where each trained turn's generated part begins, each piece tokenized alone; a token
    # starts there and is trained (the first word of every answer, whatever the header ends with)
    ids, offsets = tokens(tok, r.text, [t.start for t in r.turns])
    assert out["input_ids"][0] == ids
    starts = [a for a, _ in offsets]
    for turn in r.turns:
        if turn.start < len(r.text):
            assert out["labels"][0][starts.index(turn.start)] != IGNORE_INDEX, r.text[turn.start:turn.end]
    return trained


def name_has_private_openers(fam) -> bool:
    # harmony's reasoning closer re-opens the turn with its header (<|end|><|start|>assistant), as does the channel
    # family's (issue 45: a header the model writes itself inside its turn): trained there
    return fam.name != "gpt-oss" and fam.shape != "channel_second_header"


def oracle(tok, fam, msgs) -> str | None:
    """What each assistant turn adds after the render of the conversation before it with the generation prompt,
    through its end marker (tests/masking/oracle.py, from the family's documented end markers, not the probe's);
    None where the template is not prefix-stable on the row or refuses it."""
    verdict = prefix_oracle(tok, msgs, end_markers=fam.end_markers)
    return trained_text(verdict) if verdict.kind == DECIDED else None


# derandomized and without the example database: every family's run draws the same way in CI and locally
PROPS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
EDGE = [{"role": "user", "content": " A "}, {"role": "assistant", "content": " \nx\n "},
        {"role": "user", "content": "B\n\n"}, {"role": "assistant", "content": "é 中 🙂"}]


@pytest.mark.parametrize("name", NAMES)
def test_property_masks(toks, name):
    tok, fam = toks[name], FAMILIES[name]

    @PROPS
    @given(msgs=conversations(fam, reasoning=True, tools=True), data=st.data())
    @example(msgs=EDGE, data=None)
    def run(msgs, data):
        check_properties(tok, fam, msgs, tools=TOOLS if any(m.get("tool_calls") for m in msgs) else None)
    run()


@pytest.mark.parametrize("name", NAMES)
def test_property_matches_the_prefix_oracle(toks, name):
    tok, fam = toks[name], FAMILIES[name]
    compared = []

    @PROPS
    @given(msgs=conversations(fam, reasoning=False, tools=False))
    @example(msgs=EDGE)
    def run(msgs):
        expected = oracle(tok, fam, msgs)
        if expected is not None:
            compared.append(1)
            assert trained_chars(render_conversation(mark(msgs), tok)) == expected
    run()
    if name not in ("glm4", "glm4.5", "command-r7b-tools", "mistral-v3", "mistral-tekken"):
        assert compared, "the oracle applied to no conversation"


def test_falcon3_tool_call_turn_without_a_header_trains_by_prefix_renders(toks):
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [_call(0, False)]},
            {"role": "tool", "content": "R", "tool_call_id": "call00000"}, {"role": "assistant", "content": "a"}]
    r = render_conversation(mark(msgs), toks["falcon3"], tools=TOOLS)
    assert r.verified_by == "prefix_renders"
    call, answer = trained_chars(r).split("</tool_call><|endoftext|>")
    # the call turn: what its render adds after "<|user|>\nQ\n" (no header), through the end marker
    assert call.startswith("\n<tool_call>\n[") and '"name": "add"' in call and answer == "a<|endoftext|>"
    assert "R" not in trained_chars(r) and "Q" not in trained_chars(r)


def test_string_tool_arguments_for_templates_that_need_them(toks):
    # DeepSeek writes arguments as given: the parse stage's dict arguments are handed over as a JSON string
    tok = toks["deepseek-v3"]
    assert template_layout(tok).tool_arguments_as_string
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [_call(0, False)]},
            {"role": "tool", "content": "R", "tool_call_id": "call00000"}, {"role": "assistant", "content": "a"}]
    out = process_rows([{"messages": msgs, "tools": TOOLS}], tok, DataConfig())
    assert out["drop_reason"] == [""], out["drop_detail"]
    trained = tok.decode([i for i, lab in zip(out["input_ids"][0], out["labels"][0]) if lab != IGNORE_INDEX])
    assert '```json\n{"a": 0}\n```' in trained and trained.endswith("a<｜end▁of▁sentence｜>")


def test_deepseek_r1_second_tool_call_turn_has_no_header_and_trains_by_prefix_renders(toks):
    msgs = []
    for k in range(2):
        msgs += [{"role": "user", "content": "Q"},
                 {"role": "assistant", "content": "", "tool_calls": [_call(k, True)]},
                 {"role": "tool", "content": "R", "tool_call_id": f"call{k:05d}"},
                 {"role": "assistant", "content": "a"}]
    trained = check_properties(toks["deepseek-r1"], FAMILIES["deepseek-r1"], msgs, tools=TOOLS)
    r = render_conversation(mark(msgs), toks["deepseek-r1"], tools=TOOLS)
    assert r.verified_by == "prefix_renders"
    # the second call turn is what its render adds: R1 writes it without <｜tool▁calls▁begin｜>
    assert trained.count("<｜tool▁call▁begin｜>function<｜tool▁sep｜>add") == 2
    assert trained.count("<｜tool▁calls▁begin｜>") == 1
    assert check_properties(toks["deepseek-v3"], FAMILIES["deepseek-v3"], msgs, tools=TOOLS)  # V3 writes both
