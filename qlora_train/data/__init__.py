"""The dataset module: raw rows -> training examples with exact loss masks.

Reading rows and assembling datasets; the masks come from the mask engine (``qlora_train.masking``, its API
marked ``masking.`` below). In the order the data flows (what flows between stages is typed: a raw row's JSON
text, ``Message`` dicts marked by the ``LossPolicy``, a ``RenderedConversation``, token ids and offsets, and a
processed row whose columns ``processed.PROCESSED_ROW`` defines)::

    sources.load_source               a data.datasets entry -> raw rows (JSON text, location, source)
    handlers.apply_row_handlers       registered user functions fix raw rows
    batches.parse_readable            a batch's rows parsed once (read_json: any JSON Python refuses is a
                                      ValueError, counted); results merged back in order (merge_back)
    1 parse.canonicalize_row          raw row -> Messages marked with their train flag (masking.LossPolicy), tools,
                                      ParseReport
      formats.*                       template-free rows (segments, text, pretokenized) -> text/ids + mask
    2 masking.template_layout         the template's layout, probed once: turn openers, reasoning block, end markers
      masking.resolve_layout          model.template_layout's declared parts over the probed ones; layout_yaml
    2 masking.render_conversation     one chat-template render + verified char mask (or per-turn prefix renders)
      expand.expand_dropped_reasoning reasoning_history: expand: prefix examples for reasoning the template drops
      rule_check.selected             data.rule_check: a sample of rows also masked by the rule, token by token
                                      (masking.check_with_rule); a disagreement refuses the row (mask_disagrees)
    3 masking.encode_rendered         one batched tokenizer call per batch, each render cut where its trained turns
                                      begin (RenderedConversation.cuts); offsets project the char mask
    4 truncate.structured_truncate_messages   fit max_length, keep system + latest exchange
      masking.make_labels             the one place labels are made
    pairs.canonicalize_pair           a preference row -> prompt, chosen and rejected Messages (parse's normalisation)
    pairs.build_preference_example    prompt + two responses -> two sides, each SFT's render, walk and labels, and
                                      the prompt's tokens checked shared
    pairs.fit_pair                    both sides within max_length (and max_prompt_length / max_response_length):
                                      middle prompt exchanges dropped, reasoning trimmed (truncate's), a response
                                      cut only with max_response_length
    unpaired.canonicalize_unpaired    an unpaired row (KTO) -> prompt, completion Messages and its label
    unpaired.fit_unpaired             prompt + completion -> one sequence, a pair side's render, walk and labels,
                                      within max_length (middle prompt exchanges dropped, max_response_length cut)
    pipeline.process_rows             stages 1-4 for a batch of rows -> processed rows (processed.PROCESSED_ROW);
                                      with data.objective: preference, each row a pair (canonicalize_pair,
                                      check_score_margin, fit_pair) -> the chosen_* / rejected_* columns; with
                                      unpaired, each row one sequence (fit_unpaired) with prompt_length, desirable
    dataset.build_datasets            per-source processing, dedup, blocks, eval split, mixing, report
    packing.pack_dataset              optional: whole examples into max_length sequences (best fit decreasing)
    prepared.training_data            what training feeds: the above (+ packing), or read back from --preprocess
"""

# re-exported from the layers below (the config's schema, the shipped templates)
from qlora_train.chat_templates import get_chat_template as get_chat_template
from qlora_train.chat_templates import shipped_templates as shipped_templates
from qlora_train.config import DataConfig as DataConfig

# The data layer's own public names, imported on first use: importing one stage (``qlora_train.data.parse``) does
# not import the others or ``datasets``. The engine's names are imported from ``qlora_train.masking``.
_EXPORTS = {
    "register_row_handler": "qlora_train.data.handlers", "DropReason": "qlora_train.data.drops",
    "CanonicalRow": "qlora_train.data.parse", "ParseReport": "qlora_train.data.parse",
    "canonicalize_row": "qlora_train.data.parse", "process_rows": "qlora_train.data.pipeline",
    "TruncationResult": "qlora_train.data.truncate", "structured_truncate_messages": "qlora_train.data.truncate",
    "CanonicalPair": "qlora_train.data.pairs", "build_preference_example": "qlora_train.data.pairs",
    "canonicalize_pair": "qlora_train.data.pairs",
}
__all__ = sorted([*_EXPORTS, "DataConfig", "get_chat_template", "shipped_templates"])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qlora_train.data' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
