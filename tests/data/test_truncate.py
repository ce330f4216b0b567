"""structured_truncate_messages: what is kept, what goes first, and when the fallback is needed."""

from __future__ import annotations

from qlora_train.data import structured_truncate_messages
from qlora_train.data.truncate import measure
from qlora_train.masking.policy import LossPolicy

mark = LossPolicy().mark  # messages written by hand get their train flags as the parse stage gives them

WORDS = " ".join(f"word{i}" for i in range(60))  # ~120 tokens


def convo(n_middle, final_reasoning=""):
    msgs = [{"role": "system", "content": "SYSTEM PROMPT"}]
    for i in range(n_middle):
        msgs += [{"role": "user", "content": f"old question {i} {WORDS}"},
                 {"role": "assistant", "content": f"old answer {i} {WORDS}"}]
    final = {"role": "assistant", "content": "final answer"}
    if final_reasoning:
        final["reasoning_content"] = final_reasoning
    return mark(msgs + [{"role": "user", "content": "latest question"}, final])


def n_tokens(msgs, tok):
    return measure(msgs, tok).num_tokens


def test_fits_untouched(qwen3_tok):
    msgs = convo(2)
    r = structured_truncate_messages(msgs, qwen3_tok, max_length=10_000)
    assert r.messages == msgs and r.dropped_turns == 0 and not r.needs_token_fallback
    assert r.num_tokens_before == r.num_tokens_after == n_tokens(msgs, qwen3_tok)


def test_drops_oldest_exchanges_keeps_system_and_latest(qwen3_tok):
    msgs = convo(4)
    budget = n_tokens(convo(2), qwen3_tok)  # room for exactly two middle exchanges
    r = structured_truncate_messages(msgs, qwen3_tok, max_length=budget)
    assert r.dropped_turns == 2 and r.dropped_messages == 4
    assert r.messages == msgs[:1] + msgs[5:]  # system, exchanges 2 and 3, latest exchange
    assert r.num_tokens_after <= budget and not r.needs_token_fallback
    assert msgs[0]["content"] == "SYSTEM PROMPT"  # input untouched


def test_tool_result_before_final_answer_kept(qwen3_tok):
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    msgs = convo(3)[:-1] + mark([{"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "content": "RESULT"}, {"role": "assistant", "content": "done"}])
    r = structured_truncate_messages(msgs, qwen3_tok, max_length=n_tokens(msgs, qwen3_tok) - 50)
    assert r.messages[-4:] == msgs[-4:] and r.messages[0] == msgs[0]
    assert r.dropped_turns == 1


def test_reasoning_trimmed_before_fallback(qwen3_tok):
    msgs = convo(0, final_reasoning=WORDS)
    full = n_tokens(msgs, qwen3_tok)
    r = structured_truncate_messages(msgs, qwen3_tok, max_length=full - 40)
    kept_reasoning = r.messages[-1]["reasoning_content"]
    assert WORDS.startswith(kept_reasoning) and len(kept_reasoning) < len(WORDS)
    assert r.reasoning_trimmed_tokens >= 40 and r.num_tokens_after <= full - 40
    assert not r.needs_token_fallback and r.dropped_turns == 0


def test_middle_dropped_before_reasoning_trimmed(qwen3_tok):
    msgs = convo(2, final_reasoning=WORDS)
    r = structured_truncate_messages(msgs, qwen3_tok, max_length=n_tokens(msgs, qwen3_tok) - 100)
    assert r.dropped_turns >= 1 and r.reasoning_trimmed_tokens == 0
    assert r.messages[-1]["reasoning_content"] == WORDS


def test_fallback_only_when_needed(qwen3_tok):
    msgs = convo(1)
    msgs[-2]["content"] = "latest " + WORDS * 3
    r = structured_truncate_messages(msgs, qwen3_tok, max_length=50)
    assert r.needs_token_fallback and r.dropped_turns == 1
    assert r.messages == [msgs[0], msgs[-2], msgs[-1]]
