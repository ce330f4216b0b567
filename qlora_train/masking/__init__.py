"""The mask engine: a conversation and a tokenizer in; the chat template's own text, a verified character mask,
token ids and labels out, or a refusal (``RowRejected``) with its reason. Nothing here reads rows or builds
datasets (``qlora_train.data`` does, through this API) and nothing imports ``datasets`` or the trainer.

    >>> m = mask_conversation([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], tok)
    >>> m.text  # exactly tok.apply_chat_template(messages, tokenize=False)
    '<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n4<|im_end|>\\n'
    >>> tok.decode([t for t in m.labels if t != IGNORE_INDEX])
    '<think>\\n\\n</think>\\n\\n4<|im_end|>'

**The API** (stable; everything else here serves it, or is a fact the readers of rows share with it):

- ``mask_conversation(messages, tokenizer, *, tools, policy, layout, expand) -> MaskedConversation``: messages in
  (content a string or a list of text and image parts, ``messages.engine_messages``), a finished example out
  (``text``, ``input_ids``, ``labels``, ``example(max_length=, truncate_side=)``; with ``expand``, its ``extra``
  examples of ``reasoning_history: expand``), or ``RowRejected``;
- ``mask_pair(prompt, chosen, rejected, tokenizer, *, tools, policy, layout) -> MaskedPair``: a preference pair's two
  sides sharing ``prompt_length`` tokens, checked shared; ``mask_response(prompt, response, ...)``: one side (KTO);
- the batch form, as the dataset pipeline runs it: ``render_example`` per conversation (each inside its row's
  ``RowSpending``), then ``finish_examples`` for the batch: one tokenizer call (``text_example`` /
  ``token_example``: template-free texts and token ids join it).

**The rule** (what is trained). What the model must learn for an assistant turn is what it generates at inference
after ``render(messages[:i], add_generation_prompt=True)``. Everything that render writes (the header and whatever
the generation prompt adds after it: a pre-filled ``<think>\n\n</think>\n\n``, an opener, a channel tag) is
prompt: never trained, under every ``think_loss``; where the turn's render writes only part of it, the turn starts
where they part, out of a marker, never before the turn's header nor inside another message. Of each trained
message (``LossPolicy``: roles, per-message flags, ``last_turn_only``), the rest of ``render(messages[:i+1])``
through the turn's end marker: its generated reasoning (per ``think_loss``), content, tool calls and end-of-turn
marker (per ``train_on_eos``). Never a header, a separator after the marker, BOS, or any character of another
message. The ids are the text tokenized in pieces cut where each trained turn's generated part begins, and where
its answer resumes after a masked reasoning block (``tokenize.encode_rendered``): at inference the prompt is
tokenized alone, so the model's first token starts exactly there. A token is trained when its first character is
(``tokenize.project_char_mask``); ``tokenize.make_labels`` is the one place labels are made.

**Modules**, in the order a row goes through them:

- ``example``    **the product**: ``render_example`` -> ``finish_examples`` (``mask_conversation`` both), the one
                 composition of render, encode, projection and labels;
- ``pair``       a prompt and its responses: ``mask_pair`` / ``mask_response``, the pair's sides (``SIDES``,
                 ``mark_side``, ``pair_policy``) and its shared prompt (``shared_prompt_length``);
- ``generation`` what sampling a turn needs: the prompt rendered with the generation prompt and tokenized as at
                 inference (``render_prompt``: none of it trained), the ids a generated turn ends with
                 (``end_of_turn_tokens``);
- ``expand``     ``reasoning_history: expand``: prefix examples for reasoning the full render drops;
- ``messages``   the canonical ``Message``, the engine's ``DropReason`` (``data.drops.DropReason`` extends it)
                 and ``RowRejected``;
- ``policy``     ``LossPolicy``: which messages are trained (``mark`` flags each one) and which parts;
- ``layout``     ``TemplateLayout``, the template's facts as named parts (turn openers, end markers, reasoning
                 block, answer marker, leads, trailer, ...), found by ``probe_layout`` from a few probe renders
                 (cached per template and vocabulary by ``layout_declaration.template_layout``); its
                 ``layout_class`` names where a turn's prompt ends (``LAYOUT_CLASSES``); a fact the probe cannot
                 find stays unknown;
- ``layout_declaration``  ``model.template_layout``: a layout declared in the config, merged with the probe's
                 (``template_layout``: the probe's layout with the declaration over it, cached);
- ``row_text``   row text outside content (roles, names, ids, tool names, argument names, tool schemas) holding
                 the template's markers refuses the row (``marker_in_row_text``) before any span is looked for;
- ``apply_template``  the template's text, exactly ``apply_chat_template``'s, without transformers' per-call
                 copies of plain data (checked against it on each tokenizer's first renders);
- ``rendered``   what both paths make: ``RenderedConversation`` (text, char mask, ``TurnSpan`` per trained turn),
                 the template's text (``render_text``);
- ``render``     **the fast path**: one render of the whole conversation, walked message by message with the
                 layout, each trained turn verified (its reasoning, content, calls and end marker inside its own
                 span) -> ``RenderedConversation`` (text, char mask, ``TurnSpan`` per trained turn);
- ``prefix``     **the general path**, for rows the layout cannot verify: the rule itself, by per-turn prefix
                 renders, verified the same way (``verified_by="prefix_renders"``);
- ``images``     a vision-language model's images: ``ImageRule`` (the processor's count of an image's tokens,
                 carried on the tokenizer: ``set_image_rule``), ``expand_images`` (the processor's expansion made on
                 the render, its mask and positions moved with it; each image's tokens untrained);
- ``budget``     ``RowBudget`` (``data.row_budget``): what one row may cost in renders, characters, template steps
                 and seconds, counted by ``apply_template`` and checked by its sandbox while a template runs; a row
                 over it is ``over_budget`` (``RowSpending``, entered around each part of a row's work);
- ``tokenize``   one batched tokenizer call with offsets (``encode_rendered``: the one encode step of a render,
                 cut at its trained turns' starts), the char mask projected onto tokens, labels;
- ``count``      ``count_tokens``: exact token counts of texts (reasoning the template drops), piece by piece;
- ``check``      the fast path checked against the rule on a conversation, token by token (``check_with_rule``:
                 agree, undecided where the template is not prefix-stable, disagree).

**A refusal** is chosen, never a guess: a row neither path verifies is ``mask_unverified`` (the general path's
reason, then the layout's), a template that raises is ``template_error`` (whatever it raises: an exception of the
template's code is its refusal, ``TemplateRaised``; to the layout probe, an unknown fact); a part the template
does not write (a call, the content) refuses the row; reasoning it does not render is trained without it and
counted (``TurnSpan.reasoning_dropped``).

**To add a layout class**: give ``TemplateLayout`` the part it lacks (a field with its default "unknown"), let
``probe_layout`` find it from its probe texts (never from added-token boundaries: plain-text markers must probe
the same), teach ``render``'s walk to use it, name the class in ``LAYOUT_CLASSES``, and add a family template of
ours under tests/masking/family_templates/ with its facts in tests/masking/families.py; the hypothesis properties
against the prefix-render oracle (tests/masking/oracle.py) and ``make audit`` then check it on three vocabularies.
docs/masking.md is the long form.
"""

from __future__ import annotations

from qlora_train.masking.apply_template import TemplateRaised, call_template
from qlora_train.masking.budget import DEFAULT_BUDGET, RowBudget, RowOverBudget, RowSpending
from qlora_train.masking.check import AGREE, DISAGREE, UNDECIDED, Masked, RuleCheck, check_with_rule
from qlora_train.masking.count import count_tokens
from qlora_train.masking.example import (
    MaskedConversation,
    RenderedExample,
    finish_examples,
    mask_conversation,
    render_example,
    text_example,
    token_example,
)
from qlora_train.masking.generation import EndOfTurn, RenderedPrompt, end_of_turn_tokens, render_prompt
from qlora_train.masking.image_layouts import Idefics3Tiles, InternVLTiles, PixtralRows
from qlora_train.masking.images import ImageRule, expand_images, expanded_text, image_rule, set_image_rule
from qlora_train.masking.layout import TEMPLATE_ERRORS, TemplateLayout, probe_layout, tool_block
from qlora_train.masking.layout_declaration import (
    check_declaration,
    layout_dict,
    layout_yaml,
    resolve_layout,
    template_layout,
)
from qlora_train.masking.messages import (
    IMAGE_SLOT,
    KNOWN_ROLES,
    THINK_CLOSE,
    THINK_OPEN,
    DropReason,
    ImageInfo,
    Message,
    RowRejected,
    message_images,
)
from qlora_train.masking.pair import SIDES, MaskedPair, MaskedResponse, mark_side, mask_pair, mask_response, pair_policy
from qlora_train.masking.policy import DEFAULT_POLICY, LossPolicy, ReasoningHistory, ThinkLoss, TrainOnEos
from qlora_train.masking.rendered import render_text
from qlora_train.masking.tokenize import IGNORE_INDEX, per_vocabulary, saved_model, verify_encoder

__all__ = [
    # THE API, stable: a conversation (a prompt and its responses) in, a finished example out, or RowRejected
    "mask_conversation", "mask_pair", "mask_response", "MaskedConversation", "MaskedPair", "MaskedResponse",
    # ... its batch form: each conversation rendered inside its row's budget, all finished in one tokenizer call
    "render_example", "finish_examples", "RenderedExample", "text_example", "token_example",
    # a prompt for sampling (GRPO): rendered with the generation prompt, its ids; where a sampled turn ends
    "render_prompt", "RenderedPrompt", "end_of_turn_tokens", "EndOfTurn",
    # what goes in: canonical messages, the loss policy, a pair's sides
    "Message", "LossPolicy", "DEFAULT_POLICY", "SIDES", "mark_side", "pair_policy",
    # images in messages (masking.images): where they sit, the processor's rule for their tokens
    "IMAGE_SLOT", "ImageInfo", "ImageRule", "expand_images", "expanded_text", "image_rule", "message_images",
    "set_image_rule",
    # structured image expansions (image_layouts.py: Pixtral's rows, Idefics3's and InternVL's tiles)
    "Idefics3Tiles", "InternVLTiles", "PixtralRows",
    # what comes out: labels, refusals and their reasons
    "IGNORE_INDEX", "RowRejected", "DropReason",
    # the fast path checked against the rule (data.rule_check)
    "AGREE", "DISAGREE", "UNDECIDED", "Masked", "RuleCheck", "check_with_rule",
    # the template's layout: probed, declared (model.template_layout), printed; a render of the template
    "TEMPLATE_ERRORS", "TemplateLayout", "check_declaration", "layout_dict", "layout_yaml", "probe_layout",
    "resolve_layout", "template_layout", "tool_block", "TemplateRaised", "call_template", "render_text",
    # facts the readers of rows share with the engine: roles, reasoning tags, the policy's choices
    "KNOWN_ROLES", "THINK_CLOSE", "THINK_OPEN", "ReasoningHistory", "ThinkLoss", "TrainOnEos",
    # counting dropped reasoning; what one row may cost (data.row_budget)
    "count_tokens", "DEFAULT_BUDGET", "RowBudget", "RowOverBudget", "RowSpending",
    # data.rule_check's sample encoded by the fast byte-level encoder and by tokenizers (fast_bpe.py)
    "verify_encoder",
    # the tokenizer's saved model files, kept per vocabulary (its identity: data.identity)
    "per_vocabulary", "saved_model",
]
