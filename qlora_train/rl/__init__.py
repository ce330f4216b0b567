"""Online RL (``train.method: grpo``): what is sampled, how it is scored, and the loss on it, apart from the Trainer.

In the order a step uses them::

    rollout.sample          the policy (4-bit base + the adapter being trained) samples each prompt's completions
                            with transformers' ``generate``: token in, token out (the prompt's ids as the data
                            pipeline rendered them, each completion's ids as sampled, never decoded and re-encoded);
                            a completion without the template's end-of-turn token is truncated (``Rollout.ended``)
    rewards.load_rewards    ``rl.rewards``: each ``package.module:name`` imported once, before anything loads
    rewards.score           the reward functions called TRL's way, ``f(prompts, completions, **columns)``; a function
                            that raises or returns the wrong length stops the run naming it and the row; ``None``
                            leaves a completion out of that function's mean, counted
    loss.group_advantages   the rewards summed by weight, each completion's advantage against its group (TRL's)
    loss.grpo_loss          the clipped surrogate (``rl.loss_type``: grpo, dr_grpo, dapo) and the KL term on per-token
                            log-probs of the completions, equal to TRL 1.16's ``GRPOTrainer``

With ``rl.tools`` each rollout is multi-turn (docs/rl.md#tools)::

    tools.load_tools        ``rl.tools``: each ``package.module:name`` imported, its schema by ``get_json_schema``;
                            ``call_tool`` runs a call under a time and an output limit, errors returned to the model
    tool_calls.call_format  how the template writes a call, probed from renders of known calls (or declared:
                            ``rl.tool_call_format``); ``parse_calls`` reads a completion's calls
    agent.agent_rollout     prompt ids, sampled ids unchanged, the template's glue around each tool result tokenized
                            on its own; trained: the generated ids only; checked against the template's render
    guide.CallGuide         ``rl.guided_first_call``: a demo's first completion drawn restricted to a call's shape

The Trainer that drives them (``train.grpo``) computes the log-probs (the fused path: the output head only at
completion positions, in chunks) and feeds the Trainer's loop. Nothing here imports the trainer: this package lies
below ``train`` (the train flow, ``train.run``, builds the GRPO trainer from these parts) and above the engine, the
config and the tokenizer (tests/test_layers.py).
"""
