"""A token boundary where each trained turn's generated part begins (issue 34, shape 2).

At inference the prompt (the render up to a turn, with the generation prompt) is tokenized alone and the model's
first token begins the answer. So the ids of a training row are its render tokenized in pieces cut where each
trained turn's generated part begins (``masking.encode_rendered``); tokenized whole, a header ending in a space
(``A: ``), in ``\\n`` or in a plain-text ``>`` merges with the answer's first characters, and the first-character
rule leaves that token untrained. Checked by hand on three such headers, on a preference pair, and as a property of
random conversations.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qlora_train.data import DataConfig, build_preference_example, process_rows
from qlora_train.masking import DEFAULT_POLICY, IGNORE_INDEX, LossPolicy
from qlora_train.masking.render import render_conversation
from qlora_train.masking.tokenize import encode_rendered
from tests.masking.oracle import tokens

Q = {"role": "user", "content": "Say hello."}


def row(tok, messages, **cfg) -> dict:
    out = process_rows([{"messages": messages}], tok, DataConfig(max_length=4096, **cfg))
    assert out["drop_reason"] == [""], out["drop_detail"]
    return {k: v[0] for k, v in out.items()}


def pieces(tok, ids) -> list[str]:
    return [tok.decode([i]) for i in ids]


def trained_pieces(tok, r) -> list[str]:
    return [tok.decode([i]) for i, lab in zip(r["input_ids"], r["labels"]) if lab != IGNORE_INDEX]


@pytest.fixture(scope="module")
def qa(family_vocab_tokenizer):
    return family_vocab_tokenizer("qa-space-header")


def test_a_one_word_answer_after_a_header_ending_in_a_space_is_trained(qa):
    r = row(qa, [Q, {"role": "assistant", "content": "Hello"}])
    text = "Q: Say hello.\nA: Hello<|done|>\n"
    assert qa.decode(r["input_ids"]) == text
    # whole, the header's space and the word are one token " Hello", starting in the prompt: never trained
    assert pieces(qa, qa(text, add_special_tokens=False)["input_ids"])[-4:] == [":", " Hello", "<|done|>", "\n"]
    # cut where the answer begins: "A: " ends the prompt as it does at inference, "Hello" starts the answer
    assert pieces(qa, r["input_ids"])[-5:] == [":", " ", "Hello", "<|done|>", "\n"]
    assert trained_pieces(qa, r) == ["Hello", "<|done|>"]


def test_leading_newlines_of_qwen_content_are_trained(qwen3_tok):
    # a turn before the last keeps its content as written: the header's "\n" and the content's "\n\n" would merge
    msgs = [Q, {"role": "assistant", "content": "\n\nHello"}, {"role": "user", "content": "Again."},
            {"role": "assistant", "content": "Hi"}]
    r = row(qwen3_tok, msgs)
    at = pieces(qwen3_tok, r["input_ids"]).index("Hello")
    assert pieces(qwen3_tok, r["input_ids"])[at - 3:at + 2] == ["assistant", "\n", "\n\n", "Hello", "<|im_end|>"]
    assert r["labels"][at - 1] == r["input_ids"][at - 1]  # "\n\n": the content's, trained
    assert "".join(trained_pieces(qwen3_tok, r)) == "\n\nHello<|im_end|><think>\n\n</think>\n\nHi<|im_end|>"


def test_an_answer_starting_with_a_marker_character_after_a_plain_text_header(family_vocab_tokenizer):
    # Command R's markers as plain text (the Llama 3 vocabulary): the header's last ">" and the answer's "<" merge
    tok = family_vocab_tokenizer("command-r", "llama3 text")
    msgs = [Q, {"role": "assistant", "content": "<b>Hello</b>"}]
    r = row(tok, msgs)
    whole = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    assert pieces(tok, whole)[-14:-10] == ["|", "><", "b", ">Hello"]  # whole: "><" starts in the header
    assert pieces(tok, r["input_ids"])[-14:-10] == ["|", ">", "<b", ">Hello"]  # cut: "<b" starts the answer
    assert "".join(trained_pieces(tok, r)) == "<b>Hello</b><|END_OF_TURN_TOKEN|>"


def test_a_pair_shares_the_prompt_tokens_up_to_the_cut(qa):
    ex = build_preference_example([Q], [{"role": "assistant", "content": "Hello"}],
                                  [{"role": "assistant", "content": "Bye"}], qa)
    n = ex["prompt_length"]
    assert qa.decode(ex["chosen_input_ids"][:n]) == "Q: Say hello.\nA: "  # the whole prompt, its space included
    assert ex["chosen_input_ids"][:n] == ex["rejected_input_ids"][:n] and ex["boundary_merges"] == 0
    for side, word in (("chosen", "Hello"), ("rejected", "Bye")):
        ids, labels = ex[f"{side}_input_ids"], ex[f"{side}_labels"]
        assert qa.decode(ids[n:]) == word + "<|done|>\n"  # the response alone, from its first character
        assert labels[:n] == [IGNORE_INDEX] * n and labels[n:] == ids[n:-1] + [IGNORE_INDEX]


def test_the_generate_prompt_is_the_piece_before_the_cut(qa):
    # qlora_train.export.generate tokenizes the generation-prompt render alone: the ids of training's first piece
    prompt = qa.apply_chat_template([Q], tokenize=False, add_generation_prompt=True)
    r = row(qa, [Q, {"role": "assistant", "content": "Hello"}])
    alone = qa(prompt, add_special_tokens=False)["input_ids"]
    assert r["input_ids"][:len(alone)] == alone and r["labels"][len(alone)] != IGNORE_INDEX


# ------------------------------------------------------------------ the property, on random conversations

WORD = st.text(alphabet="abc <>\n.é", min_size=1, max_size=12).filter(lambda s: s.strip())
USER = st.text(alphabet="XYZ ?\n", min_size=1, max_size=8).filter(lambda s: s.strip())  # blank: empty_user_turn


@st.composite
def conversations(draw):
    msgs = []
    for _ in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(USER)})
        msgs.append({"role": "assistant", "content": draw(WORD)})
    return msgs


def check_turn_starts(tok, msgs, policy: LossPolicy = DEFAULT_POLICY) -> None:
    """For every trained turn a token starts exactly where its generated part begins, and it is trained (unless
    think_loss masks it); the ids are the render tokenized in pieces cut there (plain tokenizer calls)."""
    r = render_conversation(policy.mark(msgs), tok, policy=policy)
    cfg = {"think_loss": policy.think_loss, "reasoning_history": "drop"}
    out = row(tok, msgs, **cfg)
    ids, offsets = tokens(tok, r.text, [t.start for t in r.turns])
    assert out["input_ids"] == ids
    assert [ids for ids, _ in encode_rendered([r], tok)] == [ids]
    starts = [s for s, _ in offsets]
    for turn in r.turns:
        if turn.start == len(r.text):
            continue
        k = starts.index(turn.start)  # raises where no token starts there
        masked = policy.think_loss == "answer_only" and turn.body_start > turn.start
        assert (out["labels"][k] != IGNORE_INDEX) == (not masked), (r.text[turn.start:turn.end], k)


PROPS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@PROPS
@given(msgs=conversations())
@example(msgs=[Q, {"role": "assistant", "content": " <b>\n"}])
def test_property_a_token_starts_each_trained_turn_qa(qa, msgs):
    check_turn_starts(qa, msgs)


@PROPS
@given(msgs=conversations(), think_loss=st.sampled_from(["all", "answer_only"]))
@example(msgs=[Q, {"role": "assistant", "content": "\n\nx"}, Q, {"role": "assistant", "content": " \ny"}],
         think_loss="all")
def test_property_a_token_starts_each_trained_turn_qwen3(qwen3_tok, msgs, think_loss):
    check_turn_starts(qwen3_tok, msgs, LossPolicy(think_loss=think_loss))


@PROPS
@given(msgs=conversations(), name=st.sampled_from(["command-r", "zephyr", "qa-space-header"]))
def test_property_a_token_starts_each_trained_turn_plain_text_markers(family_vocab_tokenizer, msgs, name):
    check_turn_starts(family_vocab_tokenizer(name, "llama3 text"), msgs)
