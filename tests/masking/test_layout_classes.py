"""Issue 24: the engine's masks on the first Llama 3 template, five turn shapes, and markers that are plain text.

Every test compares the engine with the prefix-render oracle (tests/masking/oracle.py), never with a probed layout:

- the first Llama 3 template (``header_after_every_render``) and the five shapes A-E of families.py
  (``SHAPES``), on the real Qwen vocabulary with their markers as tokens and on the real Llama 3 vocabulary
  with their markers as plain text and as tokens: the hand-written mask of ``EXAMPLE``, and random conversations
  (tool names the user writes, reasoning, whitespace and unicode edges) equal to the oracle token by token;
- the Llama 3 template shipped in its tokenizer_config.json on its own vocabulary: a tool call it does not write
  refuses the row, the user's words are never trained (issue 24, point 0);
- every family template with its markers as plain text;
- the layout class the probe finds equals the one families.py documents.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlora_train.data import DataConfig, process_rows
from qlora_train.masking import IGNORE_INDEX, template_layout
from tests.masking.conversations import conversation
from tests.masking.families import FAMILIES, ISSUE24_NAMES, ISSUE34_NAMES, ISSUE45_NAMES, example_messages
from tests.masking.oracle import DECIDED, REFUSE, check_kept_row, pair_oracle, prefix_oracle, tokens
from tests.vocabularies import SHIPPED_TEMPLATES

# every family template probed on three vocabularies: make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

NEW = sorted(ISSUE24_NAMES + ISSUE34_NAMES + ISSUE45_NAMES)  # and the shapes of issues 34 and 45
# the family's markers as tokens on Qwen's vocabulary; on Llama 3's as plain text and as tokens
VOCABS = ("qwen+tok", "llama3 text", "llama3+tok")
CONFIG = DataConfig(max_length=4096, reasoning_history="drop")  # each row trained as its full render writes it
PROPS = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="session")
def tokenizers(family_vocab_tokenizer):
    """(family, vocabulary) -> its tokenizer, each built once per session."""
    return family_vocab_tokenizer


def engine_row(tok, messages, tools=None) -> dict:
    out = process_rows([{"messages": messages, **({"tools": tools} if tools else {})}], tok, CONFIG)
    return {k: v[0] for k, v in out.items()}


def assert_matches_the_oracle(tok, messages, tools, *, end_markers) -> str:
    """The engine's row against the oracle's verdict; returns the verdict's kind."""
    verdict = prefix_oracle(tok, messages, tools=tools, end_markers=end_markers)
    row = engine_row(tok, messages, tools)
    if verdict.kind == REFUSE:
        assert row["drop_reason"], f"kept a row the oracle refuses ({verdict.reason})"
        return verdict.kind
    if verdict.kind == DECIDED:
        assert not row["drop_reason"], f"refused a row the oracle decides: {row['drop_detail']}"
    if row["drop_reason"]:
        return verdict.kind
    trained = [lab != IGNORE_INDEX for lab in row["labels"]]
    check = check_kept_row(tok, verdict, messages, row["input_ids"], trained)
    assert not check.text_differs, "the engine's ids are not the tokens of the template's render"
    assert (check.wrong, check.missed, check.weak) == (0, 0, 0), (check, verdict.reason)
    return verdict.kind


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("name", NEW)
def test_example_mask_of_the_new_layouts(tokenizers, name, vocab):
    """``EXAMPLE`` is trained, as the oracle says; with the markers as tokens, exactly the turns written by hand
    (as plain text a marker's first or last token can hold a neighbour's character: the first-character rule)."""
    fam, tok = FAMILIES[name], tokenizers(name, vocab)
    msgs = example_messages(name)
    row = engine_row(tok, msgs)
    assert not row["drop_reason"], row["drop_detail"]
    assert_matches_the_oracle(tok, msgs, None, end_markers=fam.end_markers)
    if vocab != "llama3 text":
        trained = [i for i, lab in zip(row["input_ids"], row["labels"]) if lab != IGNORE_INDEX]
        assert tok.decode(trained) == fam.example_trained


@pytest.mark.parametrize("vocab", ("qwen+tok", "llama3 text"))
@pytest.mark.parametrize("name", NEW)
def test_random_conversations_match_the_oracle(tokenizers, name, vocab):
    fam, tok = FAMILIES[name], tokenizers(name, vocab)

    @PROPS
    @given(seed=st.integers(0, 2**32 - 1))
    def run(seed):
        msgs, tools = conversation(random.Random(seed), system=fam.supports_system,
                                   arguments_as_string=fam.tool_arguments_as_string, flags=fam.flags)
        assert_matches_the_oracle(tok, msgs, tools, end_markers=fam.end_markers)
    run()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_with_its_markers_as_plain_text(tokenizers, name):
    fam = FAMILIES[name]
    kind = assert_matches_the_oracle(tokenizers(name, "llama3 text"), example_messages(name), None,
                                     end_markers=fam.end_markers)
    assert kind != REFUSE


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_probe_finds_the_same_layout_whether_markers_are_tokens_or_plain_text(tokenizers, name):
    """Issue 24, point 1: layout facts do not depend on how the tokenizer splits the markers. Regressions:
    GLM 4.5's ``<|observation|>`` and harmony's ``<|call|>`` (what ends a tool-call turn) were found only as
    added tokens, so as plain text a call turn's end marker went untrained, or ran on into the tool result."""
    plain, tokens = (template_layout(tokenizers(name, v)) for v in ("llama3 text", "llama3+tok"))
    assert plain == tokens


@pytest.mark.parametrize("vocab", VOCABS)
def test_a_call_turn_ends_at_its_own_marker_with_the_markers_as_plain_text(tokenizers, vocab):
    """GLM 4.5 writes nothing after a call; the model stops by writing ``<|observation|>``, which is trained
    (its first token may hold the call's last '>'); the tool result after it never is."""
    tok = tokenizers("glm4.5", vocab)
    row = engine_row(tok, ISSUE_ROW[:1] + [{**ISSUE_ROW[1], "content": "let me add."}] + ISSUE_ROW[2:], ADD)
    assert not row["drop_reason"], row["drop_detail"]
    trained = tok.decode([i for i, lab in zip(row["input_ids"], row["labels"]) if lab != IGNORE_INDEX])
    assert "</tool_call><|observation|>" in trained
    assert "1220\n" not in trained and "tool_response" not in trained


ISSUE_ROW = [{"role": "user", "content": "Please add 623 and 597."},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "add", "arguments": {"a": 623, "b": 597}}, "id": "c1"}]},
             {"role": "tool", "content": "1220", "tool_call_id": "c1"},
             {"role": "assistant", "content": "It is 1220."}]
ADD = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def test_the_shipped_llama3_template_refuses_a_call_it_does_not_write(real_vocab_dir):
    """Issue 24, point 0: Meta's first template on its own vocabulary trained the user's message as the call."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_vocab_dir("llama3"))
    row = engine_row(tok, ISSUE_ROW, ADD)
    assert row["drop_reason"] == "mask_unverified" and "messages[1]" in row["drop_detail"], row["drop_detail"]
    assert_matches_the_oracle(tok, ISSUE_ROW[:1] + [{"role": "assistant", "content": "Sure."}], None,
                              end_markers=SHIPPED_TEMPLATES["llama3"]["end_markers"])


@pytest.mark.parametrize("vocab", VOCABS)
def test_the_first_llama3_template_never_trains_the_user(tokenizers, vocab):
    tok = tokenizers("llama3-original", vocab)
    for seed in range(40):
        msgs, tools = conversation(random.Random(seed), system=True, arguments_as_string=False)
        row = engine_row(tok, msgs, tools)
        if any(m.get("tool_calls") for m in msgs):
            assert row["drop_reason"], "a call the template does not write"
        assert_matches_the_oracle(tok, msgs, tools, end_markers=FAMILIES["llama3-original"].end_markers)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_probe_finds_the_documented_layout_class(tokenizers, name):
    from qlora_train.masking import template_layout

    layout = template_layout(tokenizers(name, "llama3+tok"))
    assert getattr(layout, "layout_class", None) == FAMILIES[name].layout_class


def test_a_token_a_marker_shares_with_its_neighbour_belongs_to_where_it_starts(tokenizers):
    """Issue 24, point 1, and issue 34, shape 2: with Command R7B tool_use's markers as plain text, Llama 3's
    vocabulary merges the '>' closing one marker with the '<' opening the next into one token, at both edges of each
    trained turn (``<|CHATBOT_TOKEN|><|START_RESPONSE|>``, ``<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>``). At the
    start, the render is cut where the generated part begins (as the prompt is tokenized alone at inference): the
    header's '>' ends the prompt, the answer marker's '<' starts the first trained token. At the end the rule
    decides: a token is trained when its first character is, so the end marker's last '>' trains the next turn's '<'
    with it, at every turn."""
    from qlora_train.masking.policy import LossPolicy
    from qlora_train.masking.render import render_conversation

    tok = tokenizers("command-r7b-tools", "llama3 text")
    r = render_conversation(LossPolicy().mark(example_messages("command-r7b-tools")), tok)
    ids, offsets = tokens(tok, r.text, [t.start for t in r.turns])
    row = engine_row(tok, example_messages("command-r7b-tools"))
    assert row["input_ids"] == ids
    for turn in r.turns:  # the header's last '>' a token of its own, the answer marker's '<' trained
        k = [a for a, _ in offsets].index(turn.start)
        assert r.text[offsets[k - 1][0]:offsets[k][1]].startswith(">") and row["labels"][k] != IGNORE_INDEX
    straddling = []
    for (a, b), label in zip(offsets, row["labels"]):
        if b > a and len(set(r.char_mask[a:b].tolist())) == 2:  # part trained, part masked
            straddling.append((r.text[a:b], label != IGNORE_INDEX))
            assert (label != IGNORE_INDEX) == bool(r.char_mask[a]), (r.text[a:b], label)
    assert straddling == [("><", True)] * 2  # the end edge of both turns


def _cuts_through_a_marker(fact: str) -> bool:
    """Whether a layout fact starts or ends inside a bracketed marker (``<|A|><``, ``/think>``, ``<``): a '>' or
    ']' closing nothing it opened, or a '<' or '[' it never closes."""
    depth = {"<": 0, "[": 0}
    for c in fact:
        if c in "<[":
            depth[c] += 1
        elif c in ">]":
            opener = "<" if c == ">" else "["
            if depth[opener] == 0:
                return True
            depth[opener] -= 1
    return any(depth.values())


@pytest.mark.parametrize("vocab", ("llama3 text", "llama3+tok"))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_layout_facts_never_cut_through_a_marker_nor_an_end_marker_into_an_opener(tokenizers, name, vocab):
    """Issue 34: a probed end marker never contains a turn opener nor the trailer (the first shape read
    ``<|/say|><|fin|><|seg|><|model|>``), and no layout fact starts or ends inside a marker the probe's own texts
    show whole (the fourth read ``<|answerer|><`` and ``<``)."""
    layout = template_layout(tokenizers(name, vocab))
    for marker in layout.end_markers:
        for opener in (layout.trailer, *layout.turn_openers):
            assert not opener.strip() or opener.strip() not in marker, (marker, opener)
    facts = [layout.assistant_header, *layout.turn_openers, *layout.end_markers, layout.think_open,
             layout.think_close, layout.answer_open, *layout.leads, layout.turn_start, layout.trailer]
    assert not [f for f in facts if _cuts_through_a_marker(f.strip())], facts


@pytest.mark.parametrize("vocab", VOCABS)
def test_the_trailer_is_never_trained_in_a_pair(tokenizers, vocab):
    """Issue 34, shape 1: every preference pair trained the trailer on both sides (the end marker ran into it).
    Random pairs of conversations: each side as the oracle says (only the response's turns), no token that starts
    in the trailer trained."""
    fam, tok = FAMILIES["trailer-prompt-extends"], tokenizers("trailer-prompt-extends", vocab)
    trailer = "<|seg|><|model|>"
    kept = 0
    for seed in range(12):
        msgs, tools = conversation(random.Random(seed), system=True, arguments_as_string=False)
        last_user = max(k for k, m in enumerate(msgs) if m["role"] == "user")
        prompt, chosen = msgs[:last_user + 1], msgs[last_user + 1:]
        rejected = [{"role": "assistant", "content": "no idea, sorry."}]
        out = process_rows([{"prompt": prompt, "chosen": chosen, "rejected": rejected,
                             **({"tools": tools} if tools else {})}], tok, DataConfig(objective="preference"))
        assert out["drop_reason"] == [""], out["drop_detail"]
        kept += 1
        verdicts = pair_oracle(tok, prompt, {"chosen": chosen, "rejected": rejected}, tools=tools,
                               end_markers=fam.end_markers)
        for side, response in (("chosen", chosen), ("rejected", rejected)):
            ids, labels = out[f"{side}_input_ids"][0], out[f"{side}_labels"][0]
            verdict = verdicts[side]
            assert verdict.kind == DECIDED, verdict.reason
            check = check_kept_row(tok, verdict, prompt + response, ids, [lab != IGNORE_INDEX for lab in labels],
                                   trained_messages=range(len(prompt), len(prompt) + len(response)))
            assert (check.text_differs, check.wrong, check.missed) == (0, 0, 0), check
            text = verdict.text
            enc_ids, offsets = tokens(tok, text, verdict.cuts)
            assert enc_ids == ids and text.endswith(trailer)
            assert max(a for (a, _), lab in zip(offsets, labels) if lab != IGNORE_INDEX) < (
                len(text) - len(trailer))
    assert kept == 12
