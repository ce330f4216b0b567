"""The dataset module: raw rows -> training examples with exact loss masks.

Pipeline, one stage per module::

    sources.load_source               a data.datasets entry -> raw rows (JSON text, location, source)
    handlers.apply_row_handlers       registered user functions fix raw rows
    parse.canonicalize_row            raw row -> canonical messages, tools, ParseReport
    formats.*                         template-free rows (segments, text, pretokenized) -> text/ids + mask
    truncate.structured_truncate_messages   fit max_length, keep system + latest exchange
    layout.template_layout            the template's layout, probed once: turn openers, reasoning block, end markers
    render.build_text_and_masks       one chat-template render + verified char mask
    expand.expand_dropped_reasoning   reasoning_history: expand: prefix examples for reasoning the template drops
    tokenize.tokenize_with_char_mask  offsets project the char mask -> labels
    pipeline.process_rows             all of the above for a batch of rows
    dataset.build_datasets            per-source processing, dedup, blocks, eval split, mixing, report
    packing.pack_dataset              optional: whole examples into max_length sequences (best fit decreasing)
"""

from qlora_train.config import DataConfig
from qlora_train.data.chat_templates import get_chat_template, shipped_templates
from qlora_train.data.handlers import register_row_handler
from qlora_train.data.layout import template_layout
from qlora_train.data.messages import DropReason, Message, RowRejected
from qlora_train.data.parse import CanonicalRow, ParseReport, canonicalize_row
from qlora_train.data.pipeline import process_rows
from qlora_train.data.render import build_text_and_masks, render_conversation
from qlora_train.data.tokenize import IGNORE_INDEX, make_labels, tokenize_with_char_mask
from qlora_train.data.truncate import TruncationResult, structured_truncate_messages

__all__ = [
    "CanonicalRow", "DataConfig", "DropReason", "IGNORE_INDEX", "Message", "ParseReport", "RowRejected",
    "TruncationResult", "build_text_and_masks", "canonicalize_row", "get_chat_template", "make_labels",
    "process_rows", "register_row_handler", "render_conversation", "shipped_templates", "structured_truncate_messages",
    "template_layout", "tokenize_with_char_mask",
]
