"""Proof of no contamination: a packed batch gives the same logits and loss as its examples run one by one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qlora_train.data import DataConfig, process_rows
from qlora_train.data.packing import best_fit_decreasing, pack_examples
from qlora_train.masking.tokenize import IGNORE_INDEX
from qlora_train.train.collator import PackedCollator

# runs a model per attention implementation: make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[2] / "configs" / "data" / "quickstart.jsonl"


@pytest.fixture(scope="module")
def examples(qwen3_tok):
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:10]]
    out = process_rows(rows, qwen3_tok, DataConfig(max_length=96))
    kept = [{"input_ids": i, "labels": lab} for i, lab, why in zip(out["input_ids"], out["labels"],
                                                                   out["drop_reason"]) if not why]
    assert len(kept) >= 6
    return kept


def load_float_model(model_dir, attn: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    return model.eval()


def one_by_one(model, examples):
    """Per example: logits, and the summed token loss with the boundary label masked as packing does."""
    logits, loss_sum, n_items = [], 0.0, 0
    for ex in examples:
        labels = torch.tensor([[IGNORE_INDEX] + ex["labels"][1:]])
        out = model(input_ids=torch.tensor([ex["input_ids"]]), labels=labels)
        n = int((labels[:, 1:] != IGNORE_INDEX).sum())
        logits.append(out.logits[0])
        loss_sum += out.loss.item() * n
        n_items += n
    return logits, loss_sum / n_items


@pytest.mark.parametrize("attn, mask_dtype", [("eager", torch.float32), ("sdpa", torch.bool), ("sdpa", torch.float32)],
                         ids=["eager-additive", "sdpa-bool", "sdpa-additive"])
def test_packed_batch_equals_examples_one_by_one(tiny_model_dir, examples, attn, mask_dtype):
    model = load_float_model(tiny_model_dir, attn)
    lengths = [len(ex["input_ids"]) for ex in examples]
    bins = best_fit_decreasing(lengths, capacity=200)
    assert len(bins) >= 2 and max(len(b) for b in bins) >= 2  # really packed, and a padded row in the batch
    packed = [pack_examples(examples, b) for b in bins]
    batch = PackedCollator(pad_token_id=0, mask_dtype=mask_dtype)(packed)
    with torch.no_grad():
        out = model(**batch)
        ref_logits, ref_loss = one_by_one(model, examples)
    for row, b in enumerate(bins):
        at = 0
        for piece in b:
            got = out.logits[row, at:at + piece.length]
            assert torch.allclose(got, ref_logits[piece.index], atol=1e-4, rtol=0), (row, piece)
            at += piece.length
    assert out.loss.item() == pytest.approx(ref_loss, abs=1e-4)


def test_without_the_block_mask_examples_do_leak(tiny_model_dir, examples):
    """The comparison above can fail: a plain causal mask over the same packed row changes the logits."""
    model = load_float_model(tiny_model_dir, "eager")
    packed = pack_examples(examples[:2])
    n0 = len(examples[0]["input_ids"])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([packed["input_ids"]]),
                    position_ids=torch.tensor([packed["position_ids"]]),
                    attention_mask=torch.ones(1, len(packed["input_ids"]), dtype=torch.long))
        alone = model(input_ids=torch.tensor([examples[1]["input_ids"]])).logits[0]
    assert not torch.allclose(out.logits[0, n0:], alone, atol=1e-2)
