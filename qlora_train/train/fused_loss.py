"""Where the fused loss (``loss.py``) replaces the model's own, and the forward that uses it.

``use_fused_loss(model, enabled)`` gives the CausalLM inside a peft model a forward that, when
called with ``labels`` (training and eval steps), runs the decoder and ``causal_lm_loss`` on its
hidden states and returns the loss without logits; without labels (generation) it is the model's
own forward. It returns the one log line saying which loss a run uses and, if not the fused one, why.

The fused forward is exact only for a model whose own forward is the standard one:
``outputs = self.model(...)`` -> ``logits = self.lm_head(hidden_states)`` -> ``loss =
self.loss_function(...)`` (``ForCausalLMLoss``), nothing changing the hidden states, the logits
or the loss in between. ``fused_loss_blocker`` checks that, and says what is not so:

- the output head is not a plain bias-free ``torch.nn.Linear`` (a peft LoRA layer or
  ``modules_to_save`` copy of it, a quantised head); peft's trainable tokens around one
  (``model.new_tokens``) are fine: the wrapper's ``weight`` is the Linear's with the trained rows put in;
- the config scales the logits: ``final_logit_softcapping`` (Gemma 2/3), ``logit_scale`` (Cohere),
  ``logits_scaling`` (Granite);
- the model's ``loss_function`` is not ``ForCausalLMLoss``;
- the model class's ``forward``, read from its source, assigns ``logits``, ``hidden_states`` or
  ``loss`` any other way (FalconH1's head multiplier, MiniCPM3's scaled hidden states, a MoE's
  router loss added to the loss), or calls no ``self.model`` decoder.

Under FSDP (``train.distributed: fsdp``) the head's weight is read through ``whole``: a shard FSDP has not
gathered at that point (a ``DTensor``) is all-gathered, differentiably; accelerate puts the head in one unit with
the final norm (and a tied embedding), so in practice it is already whole when the decoder returns.

Tied embeddings need nothing special: the head's weight is read at each call, so when it is the
embedding matrix the fused loss uses that very tensor, as ``lm_head`` does.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types

import torch

from qlora_train.train.loss import CHUNK_TOKENS, causal_lm_loss

LOGIT_SCALING_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
# the values the standard forward assigns to hidden_states between the decoder and the head
PLAIN_HIDDEN_STATES = ("outputs.last_hidden_state", "outputs[0]")


def use_fused_loss(model, enabled: bool, *, chunk_tokens: int = CHUNK_TOKENS) -> str:
    """Install the fused forward on the CausalLM inside ``model`` (a peft model or the CausalLM)
    when ``enabled`` and the model allows it -> the log line saying which loss training uses."""
    causal_lm = inner_causal_lm(model)
    why = fused_loss_blocker(causal_lm) if enabled else "train.fused_loss: false"
    if why:
        return f"loss: the model's own, over all logits (fused loss off: {why})"
    causal_lm.fused_loss_chunk_tokens = chunk_tokens
    causal_lm.forward = types.MethodType(_forward_for(type(causal_lm)), causal_lm)
    return (f"loss: fused LM head + cross-entropy over trained tokens only, {chunk_tokens} per chunk "
            "(train.fused_loss)")


def uses_fused_loss(model) -> bool:
    """Whether ``use_fused_loss`` installed the fused forward in ``model``."""
    return hasattr(inner_causal_lm(model), "fused_loss_chunk_tokens")


def inner_causal_lm(model):
    """The transformers CausalLM: ``model`` itself, or the one a peft model wraps."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def fused_loss_blocker(causal_lm) -> str | None:
    """Why the fused loss would not equal this model's own loss, or None when it does."""
    head = getattr(causal_lm, "lm_head", None)
    if head is None:
        return "the model has no `lm_head`"
    linear = head_linear(head)
    if type(linear) is not torch.nn.Linear:
        return f"the output head is a {type(head).__module__}.{type(head).__qualname__}, not a plain torch.nn.Linear"
    if linear.bias is not None:
        return "the output head has a bias"
    configs = [causal_lm.config]
    if hasattr(causal_lm.config, "get_text_config"):
        configs.append(causal_lm.config.get_text_config())
    for config in configs:
        for key in LOGIT_SCALING_KEYS:
            value = getattr(config, key, None)
            if value is not None:
                return f"config.{key} = {value} changes the logits after the head"
    from transformers.loss.loss_utils import ForCausalLMLoss

    loss_function = getattr(causal_lm, "loss_function", None)
    if loss_function is not ForCausalLMLoss:
        return f"the model's loss is {getattr(loss_function, '__name__', loss_function)}, not ForCausalLMLoss"
    if "forward" in vars(causal_lm):
        return "the model's forward is already replaced on the instance (e.g. by accelerate's device hooks)"
    return forward_blocker(type(causal_lm))


def head_linear(head):
    """The layer an output head computes with: the head, or the one peft's trainable tokens wrap (its
    ``weight`` is then that layer's with the trained rows put in, differentiable in them)."""
    from peft.utils import TrainableTokensWrapper

    return head.token_adapter.base_layer if isinstance(head, TrainableTokensWrapper) else head


def forward_blocker(cls) -> str | None:
    """Why ``cls.forward`` (read from its source) is not decoder -> ``lm_head`` -> ``loss_function``, or None."""
    name = f"{cls.__name__}.forward"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return f"cannot read the source of {name} to check what follows the head"
    calls = [ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)]
    if "self.model" not in calls:
        return f"{name} calls no decoder `self.model`"
    if calls.count("self.lm_head") != 1:
        return f"{name} calls `self.lm_head` {calls.count('self.lm_head')} times"
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        changed = names & {"logits", "hidden_states", "loss"}
        if changed and not _plain_assignment(node):
            return (f"{name} changes the {' and '.join(sorted(changed))} between the decoder and the loss: "
                    f"`{ast.unparse(node)}`")
    return None


def _plain_assignment(node) -> bool:
    """The standard forward's assignments: ``hidden_states = outputs.last_hidden_state`` (or
    ``outputs[0]``, or its ``slice_logits_to_keep``), ``logits = self.lm_head(hidden_states[...])``,
    ``loss = None`` and ``loss = self.loss_function(...)``."""
    if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
        return False
    target, value = node.targets[0].id, node.value
    call = ast.unparse(value.func) if isinstance(value, ast.Call) else None
    if target == "hidden_states":
        return ast.unparse(value) in PLAIN_HIDDEN_STATES or (
            call == "slice_logits_to_keep" and ast.unparse(value.args[0]) == "hidden_states")
    if target == "logits":
        arg = value.args[0] if call == "self.lm_head" and len(value.args) == 1 else None
        return arg is not None and (ast.unparse(arg) == "hidden_states" or (
            isinstance(arg, ast.Subscript) and ast.unparse(arg.value) == "hidden_states"))
    if target == "loss":
        return (isinstance(value, ast.Constant) and value.value is None) or call == "self.loss_function"
    return False


def whole(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` whole: a sharded parameter (an FSDP2 ``DTensor`` not gathered at this point) all-gathered,
    differentiably (its gradient flows back to the shards); any other tensor as it is."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def _forward_for(cls):
    """A forward for instances of ``cls``: the fused loss when called with labels, else ``cls.forward``.
    It carries ``cls.forward``'s signature (``generate`` reads it) and binds to the instance, so a
    deep copy of the model keeps the fused forward on the copy."""

    @functools.wraps(cls.forward)
    def forward(self, *args, **kwargs):
        keep = kwargs.get("logits_to_keep", 0)
        if args or kwargs.get("labels") is None or not (isinstance(keep, int) and keep == 0):
            return cls.forward(self, *args, **kwargs)
        return fused_forward(self, **kwargs)

    return forward


def fused_forward(causal_lm, *, labels, logits_to_keep=0, return_dict=None, **kwargs):
    """The standard forward with the head and loss fused: the decoder gets what the model's own forward
    passes it (``kwargs``, ``num_items_in_batch`` included), the loss is ``causal_lm_loss`` on its last
    hidden states, and no logits are returned."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    outputs = causal_lm.model(**kwargs)
    loss = causal_lm_loss(outputs[0], whole(causal_lm.lm_head.weight), labels,
                          num_items_in_batch=kwargs.get("num_items_in_batch"),
                          shift_labels=kwargs.get("shift_labels"), chunk_tokens=causal_lm.fused_loss_chunk_tokens)
    # the cache under the name this transformers gives it (``cache`` from 5.2x, ``past_key_values`` before: reading
    # the old name where it is deprecated warns on every step)
    cache = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    out = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(outputs, "hidden_states", None),
                                 attentions=getattr(outputs, "attentions", None),
                                 **{cache: getattr(outputs, cache, None)})
    return out.to_tuple() if return_dict is False else out
