"""The tokens a served model must stop at, and the ``generation_config`` that lists them.

A fine-tuned chat model ends its answer by generating the template's end-of-turn
marker (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``), because that is what
the loss trained. Servers stop at the ids in ``generation_config.eos_token_id``
(transformers, vLLM) or the tokenizer's eos; when the marker is not among them
the model "never stops" and runs on into a made-up next turn. A base model's
tokenizer often names another eos (Qwen base models: ``<|endoftext|>``), so the
marker ids are added here rather than assumed.

    >>> stop_tokens(qwen3_tok)
    StopTokens(ids=(151645,), strings=())
    >>> serving_generation_config(GenerationConfig(eos_token_id=151643), qwen3_tok).eos_token_id
    [151645, 151643]
"""

from __future__ import annotations

import copy
import logging
from typing import NamedTuple

from qlora_train.masking import end_of_turn_tokens

log = logging.getLogger(__name__)


class StopTokens(NamedTuple):
    """Where generation ends: token ids, and end markers that are not one token (stopped on as text)."""

    ids: tuple[int, ...]
    strings: tuple[str, ...] = ()


def stop_tokens(tokenizer) -> StopTokens:
    """The template's end markers as token ids (``masking.end_of_turn_tokens``, answer's first), then the
    tokenizer's eos.

    A marker made of several tokens ends with its last one (``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``
    -> ``<|END_OF_TURN_TOKEN|>``) when that is an added token; a marker of ordinary text has no id to stop
    at and is returned in ``strings``.
    """
    ids, strings = (list(part) for part in end_of_turn_tokens(tokenizer))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if strings:
        log.warning("end-of-turn marker(s) %s are not single tokens: a server must be given them as stop strings",
                    strings)
    return StopTokens(tuple(dict.fromkeys(ids)), tuple(strings))


def serving_generation_config(base, tokenizer):
    """The base model's ``GenerationConfig`` -> a copy whose ``eos_token_id`` lists the end-of-turn ids and
    the tokenizer's eos, then the base's own eos ids; ``pad_token_id`` is the tokenizer's. Sampling
    settings are the base's."""
    gen = copy.deepcopy(base)
    gen.eos_token_id = list(dict.fromkeys([*stop_tokens(tokenizer).ids, *eos_ids(base)]))
    # no longer the model config's defaults: older transformers would otherwise rebuild it from config.json
    gen._from_model_config = False
    if tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    return gen


def eos_ids(gen) -> list[int]:
    """A ``GenerationConfig``'s ``eos_token_id`` (an id, a list or None) as a list."""
    eos = gen.eos_token_id
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
