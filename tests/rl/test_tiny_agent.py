"""The agent demo's starting point (``qlora_train.tiny_agent``): its training conversations are the template's own
rollouts, the loss on the generated tokens only, the bundled demo prompts kept out. (Building the model itself takes
minutes on CPU: ``make demo-agent`` does it; two optimizer steps are checked here.)"""

from __future__ import annotations

import json

from qlora_train.tiny_agent import conversations, demo_prompts, scripted_rollouts, train_call_shape


def test_conversations_are_distinct_seeded_and_keep_the_demo_prompts_out():
    demo = demo_prompts()
    assert len(demo) == 16 and "What is 40 - 13? Use the calculator." in demo
    pairs = conversations(256, exclude=demo)
    assert pairs == conversations(256, exclude=demo)  # deterministic
    assert len({q for q, _ in pairs}) == 256 and not {q for q, _ in pairs} & demo
    assert all(q == f"What is {e}? Use the calculator." for q, e in pairs)


def test_the_training_rollouts_train_exactly_the_call_and_the_answer(qwen3_tok):
    [(ids, trained)] = scripted_rollouts(qwen3_tok, [("What is 6 * 7? Use the calculator.", "6 * 7")])
    generated = qwen3_tok.decode([i for i, t in zip(ids, trained) if t], skip_special_tokens=False)
    call = json.dumps({"name": "calculate", "arguments": {"expression": "6 * 7"}})
    assert generated == f"<tool_call>\n{call}\n</tool_call><|im_end|>The answer is 42.<|im_end|>"
    text = qwen3_tok.decode(ids, skip_special_tokens=False)
    assert "<tool_response>\n42\n</tool_response>" in text and '"name": "calculate"' in text.split("user\n")[0]


def test_two_steps_lower_the_loss_on_the_tiny_model(qwen3_tok, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    examples = scripted_rollouts(qwen3_tok, conversations(4))
    losses = []
    train_call_shape(model, examples, steps=2, lr=3e-3, batch_size=2, seed=0,
                     log=lambda line: losses.append(float(line.rsplit(" ", 1)[1])))
    assert len(losses) == 2 and losses[1] < losses[0]
