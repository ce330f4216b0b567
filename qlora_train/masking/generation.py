"""What sampling a turn needs from the template: the prompt as the model continues it, and where its turn ends.

    >>> p = render_prompt([{"role": "user", "content": "2+2?"}], tok)  # Qwen3's template
    >>> p.text
    '<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n'
    >>> p.generation_prompt, p.generation_prompt_tokens, tok.decode(p.input_ids) == p.text
    ('<|im_start|>assistant\\n', 3, True)
    >>> end_of_turn_tokens(tok)
    EndOfTurn(ids=(151645,), strings=())

The rule of the masks (``masking`` package doc) says the generated part of a turn is what the model writes after
``render(messages, add_generation_prompt=True)``: everything that render writes is prompt, the generation prompt's
text included (a header, a pre-filled empty reasoning block, an opener). ``render_prompt`` is that render of a
prompt (a conversation ending with a user turn or a tool result), tokenized in one piece as at inference (as the
masks cut an SFT row's text where a trained turn starts, so its prompt is tokenized alone): its ids are what a
sampler continues, and none of them is ever trained. ``generation_prompt`` is the part of it the generation prompt
adds to the conversation's own render (after their common prefix), ``generation_prompt_tokens`` the tokens that
start in it (what ``--debug-samples`` shows of a prompt row).

``end_of_turn_tokens`` is the template's end markers (``TemplateLayout.end_markers``, the answer's first) as token
ids: a sampled turn is whole when it ends with one (``export.stop_tokens`` adds the tokenizer's eos for serving). A
marker made of several tokens ends with its last one when that is an added token; a marker of ordinary text has no
id and is returned in ``strings``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from qlora_train.masking.example import finish_examples, text_example
from qlora_train.masking.layout import TEMPLATE_ERRORS, TemplateLayout
from qlora_train.masking.layout_declaration import template_layout
from qlora_train.masking.messages import DropReason, Message, RowRejected, engine_messages, message_images
from qlora_train.masking.prefix import common_prefix_length
from qlora_train.masking.rendered import render_text
from qlora_train.masking.row_text import check_row_text, row_text_markers

PROMPT_ENDS = ("user", "tool")  # the roles a prompt may end with: a turn for the model to answer


class RenderedPrompt(NamedTuple):
    """A prompt rendered with the generation prompt, and its ids (none of them trained)."""

    text: str  # render(messages, add_generation_prompt=True), exactly apply_chat_template's
    input_ids: list[int]
    generation_prompt: str  # the text the generation prompt adds (text[len(text) - len(generation_prompt):])
    generation_prompt_tokens: int  # the last ids, those that start in it

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class EndOfTurn(NamedTuple):
    """What a generated turn ends with: token ids, and end markers that are not one token (text)."""

    ids: tuple[int, ...]
    strings: tuple[str, ...] = ()


def render_prompt(messages: list[Message], tokenizer, *, tools: list[dict] | None = None,
                  layout: TemplateLayout | None = None) -> RenderedPrompt:
    """A prompt (canonical messages ending with a user turn or a tool result) -> its ``RenderedPrompt``, or
    ``RowRejected``: a prompt ending otherwise (``bad_row``: the data layer names it first), images (``bad_image``:
    not read for sampling yet), a marker in row text outside content, a template that raises, a lone surrogate."""
    messages = engine_messages(messages)
    if not messages or messages[-1]["role"] not in PROMPT_ENDS:
        last = f"ends with a {messages[-1]['role']} message" if messages else "is empty"
        raise RowRejected(DropReason.BAD_ROW, f"the prompt {last}: a sampled turn answers a user turn or a tool result")
    if message_images(messages):
        raise RowRejected(DropReason.BAD_IMAGE, "images in prompt rows are not supported yet")
    layout = template_layout(tokenizer) if layout is None else layout
    check_row_text(messages, tools, row_text_markers(tokenizer, layout))
    try:
        text = render_text(messages, tokenizer, tools=tools, add_generation_prompt=True, layout=layout)
        own = render_text(messages, tokenizer, tools=tools, layout=layout)
    except TEMPLATE_ERRORS as exc:
        raise RowRejected(DropReason.TEMPLATE_ERROR, f"{type(exc).__name__}: {exc}") from None
    start = common_prefix_length(own, text)
    (masked,) = finish_examples([text_example(text, np.zeros(len(text), dtype=np.uint8))], tokenizer)
    if isinstance(masked, RowRejected):
        raise masked
    _, starting = masked.offsets.tokens_before(start, len(text))
    return RenderedPrompt(text, list(masked.input_ids), text[start:], len(masked.input_ids) - starting)


def end_of_turn_tokens(tokenizer) -> EndOfTurn:
    """The template's end markers (``TemplateLayout.end_markers``, the answer's first) as token ids (see the
    module doc)."""
    added = set(tokenizer.get_added_vocab().values())
    ids, strings = [], []
    for marker in template_layout(tokenizer).end_markers:
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) == 1 or encoded and encoded[-1] in added:
            ids.append(encoded[-1])
        else:
            strings.append(marker)
    return EndOfTurn(tuple(dict.fromkeys(ids)), tuple(strings))
