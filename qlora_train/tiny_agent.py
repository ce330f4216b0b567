"""The agent demo's starting point: the tiny Qwen3 model taught the calculator's call shape (``make demo-agent``).

    python -m qlora_train.tiny --agent          # .cache/tiny-qwen3-agent, from .cache/tiny-qwen3

The random tiny model samples no tool call of its own, and a LoRA warm-up is too weak to teach it one (LoRA does
not train the tied 151,936-row embedding). So, as the GRPO demo starts from the SFT demo's adapter, the agent demo
starts from this: the tiny model with ALL its parameters trained (float32, Adam, seeded, CPU) on generated
calculator conversations, each built by ``agent_rollout`` with a scripted policy, so the prompt (the calculator's
schema in the template's tools block), the tool glue and the masks are exactly those the GRPO run will see:

    user "What is A op B? Use the calculator."  ->  <tool_call>{"name": "calculate", "arguments":
    {"expression": "A op B"}}</tool_call>  ->  the calculator's result  ->  "The answer is N."

The loss is the generated tokens' only (the call, the answer, each end-of-turn marker). The questions are drawn
from their own seed; the bundled demo prompts are not among the training conversations by construction
(``demo_prompts`` excluded).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

AGENT_DIR = ".cache/tiny-qwen3-agent"
TOOL = "qlora_train.rl.calculator:calculate"
OPS = ("+", "-", "*")
DEMO_DATA = Path(__file__).resolve().parent.parent / "configs" / "data" / "quickstart-agent.jsonl"


def conversations(n: int, *, seed: int = 0, exclude: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """``n`` distinct (question, expression) pairs ``What is A op B? Use the calculator.`` with A, B in 1..99,
    none of whose questions is in ``exclude``."""
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < n:
        expression = f"{rng.randint(1, 99)} {rng.choice(OPS)} {rng.randint(1, 99)}"
        question = f"What is {expression}? Use the calculator."
        if question not in seen:
            seen.add(question)
            out.append((question, expression))
    return out


def demo_prompts(path: str | Path = DEMO_DATA) -> frozenset[str]:
    """The bundled demo's prompts (kept out of the training conversations)."""
    path = Path(path)
    if not path.is_file():
        return frozenset()
    return frozenset(json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines() if line)


def scripted_rollouts(tokenizer, pairs):
    """Each (question, expression) as the rollout of a policy that writes the call, then ``The answer is N.``:
    ``(input_ids, trained mask)`` from ``agent_rollout`` (the template's own call text, glue and masks)."""
    from qlora_train.rl.agent import AgentLimits, agent_rollout
    from qlora_train.rl.calculator import calculate
    from qlora_train.rl.tool_calls import call_format
    from qlora_train.rl.tools import load_tools

    tools, fmt = load_tools([TOOL]), call_format(tokenizer)
    end = tokenizer.eos_token
    out = []
    for question, expression in pairs:
        call = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
        turns = iter([f"<tool_call>\n{call}\n</tool_call>{end}", f"The answer is {calculate(expression)}.{end}"])
        policy = lambda ids, turns=turns: tokenizer.encode(next(turns), add_special_tokens=False)  # noqa: E731
        rollout = agent_rollout([{"role": "user", "content": question}], policy, tokenizer, tools=tools,
                                call_format=fmt, limits=AgentLimits(max_turns=2))
        if rollout.calls != 1 or rollout.stop != "answer":
            raise RuntimeError(f"the scripted rollout of {question!r} did not call then answer: {rollout.stop}")
        out.append((rollout.input_ids, rollout.trained))
    return out


def train_call_shape(model, examples, *, steps: int, lr: float, batch_size: int, seed: int, log=print):
    """Full-parameter Adam on the examples' trained tokens (next-token cross-entropy), deterministic."""
    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    pad = model.config.pad_token_id
    for step in range(1, steps + 1):
        batch = rng.sample(examples, batch_size)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.bool)
        attention = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
        at = mask[:, 1:]  # predict token t+1 from position t where t+1 is generated
        logits = model.lm_head(hidden[:, :-1][at])
        loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:][at])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 25 == 0 or step == steps:
            log(f"step {step}/{steps}: loss {loss.item():.3f}")
    model.eval()
    return model


def taught_call_shape(base: str | Path, *, n: int = 256, steps: int = 150, lr: float = 3e-3, batch_size: int = 8,
                      seed: int = 0, log=print):
    """The tiny model at ``base`` taught the calculator's call shape (see the module doc) -> (model, tokenizer with
    the qwen3 template); ``qlora_train.tiny --agent`` saves them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qlora_train.chat_templates import get_chat_template

    tok = get_chat_template(AutoTokenizer.from_pretrained(base), "qwen3")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    examples = scripted_rollouts(tok, conversations(n, seed=seed, exclude=demo_prompts()))
    train_call_shape(model, examples, steps=steps, lr=lr, batch_size=batch_size, seed=seed, log=log)
    return model, tok
