"""The engine's product: a conversation in, its finished example out (render -> encode -> project -> labels).

    >>> m = mask_conversation([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], tok)
    >>> tok.decode([t for t in m.labels if t != IGNORE_INDEX])
    '<think>\\n\\n</think>\\n\\n4<|im_end|>'

``mask_conversation`` is one conversation, start to end. The batch form is its two halves, so that a batch's
tokens come from one tokenizer call while each row's renders stay inside its own budget (``RowSpending``):
``render_example`` for each conversation (everything that renders: the verified render, the unicode check, the
extra examples of ``reasoning_history: expand``), then ``finish_examples`` for all of them (the one encode step,
the char mask projected onto the tokens). Labels are made from a finished example (``MaskedConversation.example``:
``make_labels``, cut at a ``max_length`` where the caller says so), nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qlora_train.masking.expand import expand_dropped_reasoning
from qlora_train.masking.images import expand_images, image_rule
from qlora_train.masking.layout import TemplateLayout
from qlora_train.masking.messages import (
    DropReason,
    Message,
    RowRejected,
    check_unicode,
    engine_messages,
    message_images,
)
from qlora_train.masking.policy import DEFAULT_POLICY, LossPolicy, is_trained
from qlora_train.masking.render import render_conversation
from qlora_train.masking.rendered import RenderedConversation
from qlora_train.masking.tokenize import (
    IGNORE_INDEX,
    OffsetArray,
    Offsets,
    TokenMask,
    encode_rendered,
    make_labels,
    project_char_mask,
)


@dataclass(frozen=True)
class RenderedExample:
    """A conversation rendered for training, before its tokens (``render_example``)."""

    messages: list[Message]  # marked, as rendered (with expand: the moved turns untrained)
    tools: list[dict] | None
    rendered: RenderedConversation
    extra: tuple[RenderedExample, ...] = ()  # reasoning_history: expand: prefix examples, latest turn first
    reasoning_moved: tuple[int, ...] = ()  # turns trained (with their reasoning) in an extra example instead
    reasoning_dropped: tuple[int, ...] = ()  # trained turns whose reasoning the template does not render
    extra_left_out: int = 0  # turns of extra examples left out (a text no tokenizer encodes): trained nowhere


@dataclass(frozen=True)
class MaskedConversation:
    """A conversation's render with its verified mask, its tokens and which of them are trained."""

    messages: list[Message]
    tools: list[dict] | None
    rendered: RenderedConversation  # text, char_mask, one TurnSpan per trained turn, which path verified it
    input_ids: list[int]
    offsets: Offsets
    token_mask: TokenMask  # the char mask on the tokens: a token is trained when its first character is
    extra: tuple[MaskedConversation, ...] = ()
    reasoning_moved: tuple[int, ...] = ()
    reasoning_dropped: tuple[int, ...] = ()
    extra_left_out: int = 0  # also the turns of extra examples whose tokens could not be made

    @property
    def text(self) -> str:
        return self.rendered.text

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def labels(self) -> list[int]:
        """``input_ids`` where trained, ``IGNORE_INDEX`` elsewhere (no cut)."""
        return self.example()["labels"]

    def example(self, *, max_length: int | None = None, truncate_side: str = "left") -> dict[str, list[int]]:
        """``input_ids``, ``attention_mask``, ``labels`` (``make_labels``), cut to ``max_length`` on
        ``truncate_side`` where longer."""
        return make_labels(self.input_ids, self.token_mask, max_length=max_length, truncate_side=truncate_side)

    def trains_past(self, n: int) -> bool:
        """Whether a token at or after position ``n`` is trained (a cut there loses trained tokens)."""
        return any(end > n for _, end in self.token_mask.runs)


def render_example(messages: list[Message], tokenizer, *, tools: list[dict] | None = None,
                   policy: LossPolicy = DEFAULT_POLICY, layout: TemplateLayout | None = None,
                   expand: bool = False) -> RenderedExample:
    """Marked messages -> ``RenderedExample``, or ``RowRejected``: the verified render (``render_conversation``),
    refused where it holds a lone surrogate (``invalid_unicode``); with ``expand`` (``reasoning_history:
    expand``), the extra prefix examples for the turns whose reasoning the render drops (``expand``), an extra
    one no tokenizer could encode left out and counted."""
    for i, m in enumerate(messages):
        if m.get("images") and image_rule(tokenizer) is None:
            raise RowRejected(DropReason.BAD_IMAGE, "the row has images and the model reads none (model.name_or_path "
                              "is not a vision-language model with an image processor)")
        if m.get("images") and is_trained(m, i):
            raise RowRejected(DropReason.BAD_IMAGE, f"messages[{i}]: an image in a trained turn (a model does not "
                              "write images: put it in the user turn before, or train another turn)")
    raw = render_conversation(messages, tokenizer, tools=tools, policy=policy, layout=layout)
    rendered = _expanded(raw, messages, tokenizer)
    check_unicode(rendered.text, rendered.message_ends)
    dropped = tuple(t.index for t in rendered.turns if t.reasoning_dropped)
    if not (dropped and expand and policy.reasoning_history_max_examples):
        return RenderedExample(messages, tools, rendered, reasoning_dropped=dropped)
    ex = expand_dropped_reasoning(messages, raw, tokenizer, tools=tools, policy=policy)  # renders (before expansion)
    extra, left_out = [], 0
    for m, r in ex.extra:
        if message_images(m):  # an extra example's images would need their own pixels: left out, counted
            left_out += len(r.turns)
            continue
        try:  # reasoning only an extra example writes, with a lone surrogate: left out like a refused one
            r = _expanded(r, m, tokenizer)
            check_unicode(r.text, r.message_ends)
        except RowRejected:
            left_out += len(r.turns)
            continue
        extra.append(RenderedExample(m, tools, r))
    primary = _expanded(ex.primary, ex.messages, tokenizer)
    return RenderedExample(ex.messages, tools, primary, tuple(extra), ex.moved, ex.still_dropped, left_out)


def _expanded(rendered: RenderedConversation, messages: list[Message], tokenizer) -> RenderedConversation:
    """The render with each image's tokens as the processor expands them (``images.expand_images``), for a
    vision-language model's tokenizer (``images.image_rule``)."""
    rule = image_rule(tokenizer)
    return rendered if rule is None else expand_images(rendered, message_images(messages), rule)


def text_example(text: str, char_mask: np.ndarray) -> RenderedExample:
    """A template-free text (``data.formats``: segments, plain text) with its char mask, to be finished with the
    batch's renders (not cut: no turn of it begins a generated part)."""
    check_unicode(text)
    return RenderedExample([], None, RenderedConversation(text, char_mask, (len(text),), ()))


def token_example(ids: list[int], token_mask: np.ndarray) -> MaskedConversation:
    """Token ids given with their mask, 1 per trained token (``data.formats``: pretokenized rows) -> their finished
    example: no text, each token its own character."""
    starts = np.arange(len(ids), dtype=np.int64)
    offsets = OffsetArray(np.stack([starts, starts + 1], axis=1))
    rendered = RenderedConversation("", token_mask, (len(ids),), ())
    return MaskedConversation([], None, rendered, ids, offsets, project_char_mask(offsets, token_mask))


def finish_examples(examples: Sequence[RenderedExample], tokenizer) -> list[MaskedConversation | RowRejected]:
    """Rendered examples -> their tokens, in one tokenizer call (``encode_rendered``: each render cut where its
    trained turns begin), each char mask projected onto its tokens. One that no tokenizer call encodes is its
    ``RowRejected`` (``bad_row``: the batch is encoded again one text at a time); an extra example that fails is
    left out of its example and counted in ``extra_left_out``."""
    flat = [r for ex in examples for r in (ex, *ex.extra)]
    encoded = iter(_encode_each([r.rendered for r in flat], tokenizer))
    out: list[MaskedConversation | RowRejected] = []
    for ex in examples:
        primary, extra, left_out = next(encoded), [], ex.extra_left_out
        for r in ex.extra:
            enc = next(encoded)
            if isinstance(enc, RowRejected):
                left_out += len(r.rendered.turns)
            else:
                extra.append(_masked(r, *enc))
        if isinstance(primary, RowRejected):
            out.append(primary)
        else:
            out.append(_masked(ex, *primary, extra=tuple(extra), reasoning_moved=ex.reasoning_moved,
                               reasoning_dropped=ex.reasoning_dropped, extra_left_out=left_out))
    return out


def mask_conversation(messages: list[Message], tokenizer, *, tools: list[dict] | None = None,
                      policy: LossPolicy = DEFAULT_POLICY, layout: TemplateLayout | None = None,
                      expand: bool = False) -> MaskedConversation:
    """Messages (content a string or content parts: ``messages.engine_messages``; a message's own ``train`` flag,
    where set, is kept, else ``policy`` marks it) -> their ``MaskedConversation``, or ``RowRejected``:
    ``render_example`` then ``finish_examples``."""
    example = render_example(policy.mark(engine_messages(messages)), tokenizer, tools=tools, policy=policy,
                             layout=layout, expand=expand)
    (masked,) = finish_examples([example], tokenizer)
    if isinstance(masked, RowRejected):
        raise masked
    return masked


def _masked(ex: RenderedExample, ids: list[int], offsets: Offsets, **facts) -> MaskedConversation:
    return MaskedConversation(ex.messages, ex.tools, ex.rendered, ids, offsets,
                              project_char_mask(offsets, ex.rendered.char_mask), **facts)


def _encode_each(renders: list[RenderedConversation], tokenizer) -> list[tuple[list[int], Offsets] | RowRejected]:
    """``encode_rendered``, falling back to one text at a time so that one bad text cannot fail the batch."""
    try:
        return encode_rendered(renders, tokenizer)
    except Exception:
        out = []
        for render in renders:
            try:
                out.append(encode_rendered([render], tokenizer)[0])
            except Exception as exc:  # a text the tokenizer cannot encode: that row's refusal, not the batch's
                out.append(RowRejected.unexpected(exc))
        return out


__all__ = ["IGNORE_INDEX", "MaskedConversation", "RenderedExample", "finish_examples", "mask_conversation",
           "render_example", "text_example", "token_example"]
