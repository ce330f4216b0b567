"""The dataset module: raw rows -> training examples with exact loss masks.

Reading rows and assembling datasets; the masks come from the mask engine (``qlora_train.masking``: a conversation
in, a finished example out). In the order the data flows::

    sources.load_source            a data.datasets entry -> raw rows (JSON text, location, source)
    handlers.apply_row_handlers    registered user functions fix raw rows
    batches.parse_readable         a batch's rows parsed once (read_json: any JSON Python refuses is a ValueError,
                                   counted); results merged back in order (merge_back)
    images.image_info              a row's image references resolved (the data file's directory) and checked
                                   (regular files only, formats read, pixels from the header under Pillow's guard,
                                   verify, decode): bad_image; pixels read only by the collator (open_image: upright)
    pipeline.objective             data.objective -> its Objective, decided once: its pipeline and its row type
                                   (processed.SFT_ROW, PAIR_ROW, UNPAIRED_ROW, PROMPT_ROW: the columns a processed
                                   row holds)
    sft.process_sft_rows           SFT: parse.canonicalize_row (Messages marked by the LossPolicy, tools, a
                                   ParseReport) -> masking.render_example (with reasoning_history: expand, the
                                   extra examples) -> rule_check on a sample -> masking.finish_examples (one tokenizer
                                   call per batch) -> truncate.structured_truncate_messages -> labels;
                                   formats.* rows (segments, text, pretokenized) skip the template
    pairs.process_pair_rows        DPO / ORPO: pairs.canonicalize_pair -> check_score_margin -> rule_check ->
                                   pairs.fit_pair (masking.mask_pair: both sides, the prompt checked shared; middle
                                   prompt exchanges dropped, reasoning trimmed, responses cut with max_response_length)
    unpaired.process_unpaired_rows KTO: unpaired.canonicalize_unpaired -> rule_check -> unpaired.fit_unpaired
                                   (masking.mask_response)
    prompts.process_prompt_rows    GRPO: prompts.canonicalize_prompt (the prompt, its tools, the row's other columns
                                   for the rewards) -> prompts.fit_prompt (masking.render_prompt: the render with the
                                   generation prompt, nothing trained; middle exchanges dropped to fit)
    rows.Batch                     what every pipeline shares: a batch's rows, outputs, budgets (data.row_budget),
                                   refusals; the filters (min_chars / max_chars, the dedup hash)
    rule_check                     data.rule_check: a sample of rows also masked by the rule, token by token
    dataset.build_datasets         per-source processing, dedup, blocks, eval split, mixing, report
    packing.pack_dataset           optional: whole examples into max_length sequences (best fit decreasing)
    prepared.training_data         what training feeds: the above (+ packing), or read back from --preprocess
                                   (prepared_checks: its files' hashes and every row's tokens checked)
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
