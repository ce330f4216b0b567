"""Issues 45 and 53: what the generation prompt writes is prompt; an answer starts with its own first character.

The rule: what the model must learn for an assistant turn is what it generates at inference after
``render(messages[:i], add_generation_prompt=True)``. Everything that render writes (the header and whatever the
generation prompt adds after it: a pre-filled empty reasoning block, a reasoning opener, a channel tag) is prompt,
never trained, under every ``think_loss``. Each shape is a family template of ours (tests/masking/families.py,
``ISSUE45_NAMES``), checked here by hand, on both paths (the layout's walk and the prefix renders), by the rule check,
and, through the whole pipeline, against the prefix-render oracle (test_layout_classes.py runs them on three
vocabularies). With ``think_loss: answer_only`` the separator a template writes after the reasoning block is the
template's, the answer's own leading whitespace is the answer's: its first character is trained (issue 53).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qlora_train.chat_templates import get_chat_template
from qlora_train.data import DataConfig, process_rows
from qlora_train.masking import (
    AGREE,
    DISAGREE,
    IGNORE_INDEX,
    LossPolicy,
    RowRejected,
    check_with_rule,
    mask_conversation,
    mask_pair,
    mask_response,
    template_layout,
)
from qlora_train.masking.prefix import render_by_prefixes
from qlora_train.masking.render import render_conversation
from tests.masking.families import FAMILIES
from tests.masking.oracle import DECIDED, check_kept_row, prefix_oracle

mark = LossPolicy().mark


def trained(r) -> str:
    """The trained characters of a render (either path)."""
    return "".join(c for c, m in zip(r.text, r.char_mask) if m)


def trained_tokens(tok, m) -> str:
    return tok.decode([t for t in m.labels if t != IGNORE_INDEX])


def both_paths(tok, msgs, tools=None, policy: LossPolicy | None = None) -> str:
    """The trained text, the same by the layout's walk and by the rule's prefix renders."""
    policy = policy or LossPolicy()
    fast = render_conversation(mark(msgs), tok, tools=tools, policy=policy)
    rule = render_by_prefixes(mark(msgs), tok, tools=tools, policy=policy)
    assert (fast.verified_by, trained(fast)) == ("layout", trained(rule))
    return trained(fast)


Q = {"role": "user", "content": "What is the capital of France?"}
Q2 = {"role": "user", "content": "And of Italy?"}


def answer(content: str, reasoning: str | None = None) -> dict:
    return {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}


# ------------------------------------------------------------------ the shapes, by hand


def test_an_empty_block_the_generation_prompt_prefills_is_never_trained(family_vocab_tokenizer):
    tok = family_vocab_tokenizer("prefilled-empty-think")
    assert template_layout(tok).prompt_tail == "<think>\n\n</think>\n\n"
    # every turn writes the empty block the generation prompt pre-fills: the answer alone is generated
    assert both_paths(tok, [Q, answer("Paris."), Q2, answer("Rome.")]) == "Paris.<|te|>Rome.<|te|>"
    # a turn with reasoning parts from the pre-filled block after '<think>\n': the reasoning on is generated
    msgs = [Q, answer("Paris.", "France's capital."), Q2, answer("Rome.")]
    assert both_paths(tok, msgs) == "France's capital.\n</think>\n\nParis.<|te|>Rome.<|te|>"
    assert both_paths(tok, msgs, policy=LossPolicy(think_loss="answer_only")) == "Paris.<|te|>Rome.<|te|>"
    think = tok.convert_tokens_to_ids("<think>")
    assert think not in [t for t in mask_conversation(msgs, tok).labels if t != IGNORE_INDEX]


def test_an_opener_the_generation_prompt_writes_is_never_trained(family_vocab_tokenizer):
    tok = family_vocab_tokenizer("opener-prompt")
    assert (template_layout(tok).assistant_header, template_layout(tok).prompt_tail) == (
        "<|begin|>assistant<|sep|>", "<reason>")
    msgs = [Q, answer("Paris.", "because"), Q2, answer("Rome.")]
    # the reasoning, its close and the answer are generated; the opener the prompt wrote is not
    assert both_paths(tok, msgs) == "because</reason>Paris.<|finish|></reason>Rome.<|finish|>"
    assert both_paths(tok, msgs, policy=LossPolicy(think_loss="answer_plus_think")) == (
        "becauseParis.<|finish|>Rome.<|finish|>")


def test_a_system_flag_that_switches_the_generation_prompt_is_read_per_row(family_vocab_tokenizer):
    tok = family_vocab_tokenizer("thinking-flag")
    layout = template_layout(tok)
    assert layout.prompt_by_row and layout.prompt_tail == "<think>\n"  # the flag found in the template's own text
    plain = [{"role": "system", "content": "Be brief."}, Q, answer("Paris.", "easy"), Q2, answer("Rome.")]
    assert both_paths(tok, plain) == "easy\n</think>\n\nParis.<|/im|>\n</think>\n\nRome.<|/im|>"
    flagged = [{"role": "system", "content": "Be brief. /skip_thinking"}, *plain[1:]]
    # thinking off: the generation prompt pre-fills the empty block every answer writes; reasoning is not written
    assert both_paths(tok, flagged) == "Paris.<|/im|>Rome.<|/im|>"
    r = render_conversation(mark(flagged), tok)
    assert [t.reasoning_dropped for t in r.turns] == [True, False]
    assert check_with_rule(mark(flagged), r, tok).outcome == AGREE


def test_a_tool_result_written_differently_when_last_stays_out_of_the_answer(family_vocab_tokenizer):
    tok = family_vocab_tokenizer("tool-last-differs")
    call = {"type": "function", "id": "c1", "function": {"name": "get", "arguments": {"key": "weather"}}}
    prompt = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    tools = [{"type": "function", "function": {"name": "get", "description": "get", "parameters": {
        "type": "object", "properties": {"key": {"type": "string"}}}}}]
    # the generation prompt's render ends the tool turn '</tool_response><|msg_close|>', the answer's render
    # '</tool_response>\n<|msg_close|>': they part inside the tool turn; the answer starts after its header
    text = both_paths(tok, [*prompt, answer("It is sunny.")], tools)
    assert text.endswith("</tool_call><|msg_close|>It is sunny.<|msg_close|>"), text
    pair = mask_pair(prompt, [answer("It is sunny.")], [answer("No idea.")], tok, tools=tools)
    assert trained_tokens(tok, pair.chosen) == "It is sunny.<|msg_close|>"  # the response's turn only
    shared = tok.decode(pair.chosen.input_ids[:pair.prompt_length])
    assert shared.endswith("</tool_response>\n<|msg_close|>\n<|msg_open|>assistant\n")
    alone = mask_response(prompt, [answer("It is sunny.")], tok, tools=tools)
    assert alone.sequence.input_ids == pair.chosen.input_ids and alone.prompt_length == pair.prompt_length


def test_a_header_the_model_writes_inside_its_turn_is_trained_the_prompts_is_not(family_vocab_tokenizer):
    tok = family_vocab_tokenizer("channel-second-header")
    msgs = [Q, answer("Paris.", "capital of France"), Q2, answer("Rome.")]
    assert both_paths(tok, msgs) == ("thoughts<|body|>capital of France<|stop|><|head|>assistant<|chan|>reply<|body|>"
                                     "Paris.<|stop|>reply<|body|>Rome.<|stop|>")
    m = mask_conversation(msgs, tok)
    head = tok.convert_tokens_to_ids("<|head|>")
    assert sum(t == head and lab != IGNORE_INDEX for t, lab in zip(m.input_ids, m.labels)) == 1  # the model's own


def test_qwen_templates_without_and_with_an_opener(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    msgs = [{"role": "user", "content": "2+2?"}, answer("4")]
    off = get_chat_template(AutoTokenizer.from_pretrained(qwen_tokenizer_dir), "qwen3", {"enable_thinking": False})
    assert trained_tokens(off, mask_conversation(msgs, off)) == "4<|im_end|>"  # the block off pre-fills is prompt
    on = get_chat_template(AutoTokenizer.from_pretrained(qwen_tokenizer_dir), "qwen3")
    assert trained_tokens(on, mask_conversation(msgs, on)) == "<think>\n\n</think>\n\n4<|im_end|>"  # generated
    opener = get_chat_template(AutoTokenizer.from_pretrained(qwen_tokenizer_dir), "qwen3.5")
    assert trained_tokens(opener, mask_conversation(msgs, opener)) == "\n</think>\n\n4<|im_end|>"


def test_the_rule_check_catches_a_layout_that_trains_the_prompts_text(family_vocab_tokenizer):
    tok = family_vocab_tokenizer("prefilled-empty-think")
    wrong = dataclasses.replace(template_layout(tok), prompt_tail="")  # as the engine read every template before
    msgs = mark([Q, answer("Paris.")])
    r = render_conversation(msgs, tok, layout=wrong)
    assert trained(r) == "<think>\n\n</think>\n\nParis.<|te|>"
    check = check_with_rule(msgs, r, tok, layout=wrong)
    assert check.outcome == DISAGREE and "the rule" in check.detail


@pytest.mark.slow
def test_debug_samples_show_no_prefilled_block_trained(family_vocab_tokenizer, tmp_path, capsys, monkeypatch):
    from qlora_train.cli import main
    from qlora_train.diagnostics.html import read_tokens

    tok = family_vocab_tokenizer("prefilled-empty-think")
    tok.save_pretrained(tmp_path / "tok")
    rows = [{"messages": [Q, answer("Paris."), Q2, answer("Rome.")]},
            {"messages": [Q, answer("Paris.", "France's capital.")]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"name_or_path": str(tmp_path / "tok")},
           "data": {"datasets": [{"path": str(tmp_path / "d.jsonl")}], "think_loss": "all"},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("NO_COLOR", "1")
    assert main(["--config", str(tmp_path / "cfg.yaml"), "--debug-samples", "2", "--stats-dir", str(tmp_path)]) == 0
    page = read_tokens((tmp_path / "debug_samples.html").read_text())
    texts = ["".join(t for on, _, t in tokens if on) for tokens in page.values()]
    assert texts == ["Paris.<|te|>Rome.<|te|>", "France's capital.\n</think>\n\nParis.<|te|>"]


# ------------------------------------------------------------------ content parts in the API (issue 45, point 4)


def test_the_api_takes_content_parts(qwen3_tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]
    text = [{"role": "user", "content": "2+2?"}, answer("4")]
    assert mask_conversation(parts, qwen3_tok).input_ids == mask_conversation(text, qwen3_tok).input_ids
    pair = mask_pair(parts[:1], parts[1:], [{"role": "assistant", "content": None}, ], qwen3_tok)
    assert trained_tokens(qwen3_tok, pair.chosen).endswith("4<|im_end|>")
    assert mask_response(parts[:1], parts[1:], qwen3_tok).prompt_length == pair.prompt_length


@pytest.mark.parametrize(("content", "reason", "says"), [
    (5, "bad_content_type", "messages[0]: content of type int"),
    ([{"type": "audio", "audio": "x.wav"}], "bad_content_type",
     "messages[0].content[0]: a content part of type 'audio'"),
    (["plain"], "bad_content_type", "messages[0].content[0]: a content part of type str"),
    ([{"type": "image", "image": "a.png"}], "bad_image", "messages[0].content[0]: an image part needs its width"),
    ([{"type": "image", "width": 28, "height": 28}], "bad_image", "the row has images and the model reads none"),
])
def test_content_the_api_cannot_read_is_a_refusal_never_an_exception(qwen3_tok, content, reason, says):
    with pytest.raises(RowRejected) as err:
        mask_conversation([{"role": "user", "content": content}, answer("4")], qwen3_tok)
    assert err.value.reason == reason and says in err.value.detail


# ------------------------------------------------------------------ issue 53: an answer's own leading whitespace

# every family whose template writes reasoning somewhere (a block before the answer)
REASONING_FAMILIES = sorted(n for n, f in FAMILIES.items() if f.reasoning != "none")
PAD = st.sampled_from(["", " ", "  ", "\n", "\n\n", "\t", " \n", "\n  ", "\t "])
WORD = st.sampled_from(["leading spaces and trailing spaces", "ok", "1. first\n2. second", "é 中 🙂"])
PROPS = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@st.composite
def padded_conversations(draw, fam):
    msgs = [{"role": "system", "content": "Be brief."}] if fam.supports_system and draw(st.booleans()) else []
    for k in range(draw(st.integers(1, 2))):
        msgs.append({"role": "user", "content": f"Question {k}?"})
        m = answer(draw(PAD) + draw(WORD) + draw(PAD))
        if draw(st.booleans()):
            m["reasoning_content"] = draw(PAD) + "some reasoning" + draw(PAD)
        msgs.append(m)
    return msgs


def first_character_trained(tok, verdict, out) -> None:
    """The token holding each answer's first character as the template writes it is trained."""
    from tests.masking.oracle import tokens

    ids, offsets = tokens(tok, verdict.text, verdict.cuts)
    trained_at = [lab != IGNORE_INDEX for lab in out["labels"][0]]
    for a, _ in verdict.spans:
        k = next(k for k, (s, e) in enumerate(offsets) if s <= a < e or s >= a)
        assert trained_at[k], (verdict.text[a:a + 20], tok.decode([ids[k]]))


@pytest.mark.slow
@pytest.mark.parametrize("think_loss", ["all", "answer_only"])
@pytest.mark.parametrize("name", REASONING_FAMILIES)
def test_property_an_answer_that_starts_with_whitespace_trains_its_first_word(family_vocab_tokenizer, name,
                                                                                think_loss):
    fam, tok = FAMILIES[name], family_vocab_tokenizer(name)
    decided = []

    @PROPS
    @given(msgs=padded_conversations(fam))
    @example(msgs=[{"role": "user", "content": "Q?"}, answer("  leading spaces and trailing spaces  ", "r")])
    def run(msgs):
        verdict = prefix_oracle(tok, msgs, end_markers=fam.end_markers, think_loss=think_loss)
        out = process_rows([{"messages": msgs}], tok, DataConfig(max_length=4096, reasoning_history="drop",
                                                                  think_loss=think_loss))
        if verdict.kind != DECIDED or out["drop_reason"][0]:
            assert verdict.kind != DECIDED or not out["drop_reason"][0], out["drop_detail"]
            return
        decided.append(1)
        check = check_kept_row(tok, verdict, msgs, out["input_ids"][0],
                               [lab != IGNORE_INDEX for lab in out["labels"][0]])
        assert (check.text_differs, check.wrong, check.missed) == (False, 0, 0), (check, verdict.text)
        first_character_trained(tok, verdict, out)
    run()
    if name not in ("glm4.5", "gpt-oss"):  # reasoning shown only for the last message: rows may not be decided
        assert decided, "the oracle decided no conversation"
