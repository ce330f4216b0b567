"""The fused loss equals the model's own: loss and every LoRA gradient, in float32 on CPU, on the tiny
Qwen3 with the real 151,936-token vocabulary; and it falls back where it cannot be exact."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from qlora_train.data import DataConfig, process_rows
from qlora_train.data.packing import best_fit_decreasing, pack_examples
from qlora_train.masking.tokenize import IGNORE_INDEX
from qlora_train.train.collator import PackedCollator, PadCollator
from qlora_train.train.fused_loss import forward_blocker, fused_loss_blocker, use_fused_loss, uses_fused_loss
from qlora_train.train.loss import CHUNK_TOKENS, causal_lm_loss

SAMPLE = Path(__file__).resolve().parents[2] / "configs" / "data" / "quickstart.jsonl"
VOCAB = 151936
CHUNK = 16  # small, so that every batch here is cut into several chunks, the last one short
REL = 1e-5


@pytest.fixture(scope="module")
def examples(qwen3_tok):
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:8]]
    out = process_rows(rows, qwen3_tok, DataConfig(max_length=64))
    kept = [{"input_ids": i, "labels": lab} for i, lab, why in zip(out["input_ids"], out["labels"],
                                                                   out["drop_reason"]) if not why]
    assert len(kept) >= 6
    return kept[:6]


def padded_batches(examples):
    """Two micro-batches of three padded examples."""
    collate = PadCollator(pad_token_id=0)
    return [collate([{**ex, "attention_mask": [1] * len(ex["input_ids"])} for ex in examples[i:i + 3]])
            for i in (0, 3)]


def packed_batches(examples):
    """Two micro-batches of packed rows (several examples per row; SDPA's boolean block mask)."""
    collate = PackedCollator(pad_token_id=0, mask_dtype=torch.bool)
    batches = []
    for part in (examples[:3], examples[3:]):
        bins = best_fit_decreasing([len(ex["input_ids"]) for ex in part], capacity=110)
        assert max(len(b) for b in bins) >= 2  # really packed
        batches.append(collate([pack_examples(part, b) for b in bins]))
    return batches


@pytest.fixture(scope="module")
def lora_model(tiny_model_dir):
    """The tiny model in float32 with LoRA on every linear layer, A and B random (B = 0 would zero A's grads)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False,
                      task_type="CAUSAL_LM")
    return get_peft_model(base, lora)


def fused_copy(model, chunk_tokens=CHUNK):
    fused = copy.deepcopy(model)
    assert use_fused_loss(fused, True, chunk_tokens=chunk_tokens).startswith("loss: fused LM head")
    assert uses_fused_loss(fused) and not uses_fused_loss(model)
    return fused


def run_steps(model, batches, num_items_in_batch):
    """One optimizer step's forward and backward over ``batches`` -> (losses, gradient of each trainable parameter)."""
    model.zero_grad(set_to_none=True)
    losses = []
    for batch in batches:
        extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
        loss = model(**batch, **extra).loss
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def trained_count(batches) -> torch.Tensor:
    """What the Trainer passes as num_items_in_batch: trained labels after the shift, over the accumulated batches."""
    return sum((b["labels"][..., 1:] != IGNORE_INDEX).sum() for b in batches)


def assert_same(default, fused):
    (d_losses, d_grads), (f_losses, f_grads) = default, fused
    assert len(f_losses) == len(d_losses)
    for d, f in zip(d_losses, f_losses):
        assert abs(f - d) <= REL * abs(d), (d, f)
    assert f_grads.keys() == d_grads.keys() and len(d_grads) == 2 * 7 * 2  # A and B of 7 linears in 2 layers
    for name, d in d_grads.items():
        assert d.norm() > 0, name
        assert (f_grads[name] - d).norm() <= REL * d.norm(), name


@pytest.mark.parametrize("make_batches", [padded_batches, packed_batches], ids=["padded", "packed"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["one-batch", "accumulated"])
def test_loss_and_lora_gradients_equal_the_default_path(lora_model, examples, make_batches, accumulate):
    batches = make_batches(examples)
    if not accumulate:  # one micro-batch, the loss a mean over its trained tokens
        batches, num_items = batches[:1], None
    else:  # two micro-batches, each loss summed and divided by the trained tokens of both (the Trainer's way)
        num_items = trained_count(batches)
    fused = fused_copy(lora_model)
    assert_same(run_steps(lora_model, batches, num_items), run_steps(fused, batches, num_items))


def test_accumulation_semantics_are_what_the_comparison_sees(lora_model, examples):
    """The accumulated case can fail: per-micro-batch means give another loss than the shared denominator."""
    batches = padded_batches(examples)
    shared, _ = run_steps(lora_model, batches, trained_count(batches))
    means, _ = run_steps(lora_model, batches, None)
    assert all(abs(s - m) > 100 * REL * abs(m) for s, m in zip(shared, means))


def test_with_gradient_checkpointing(tiny_model_dir, examples):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                            init_lora_weights=False, task_type="CAUSAL_LM"))
    model.train()
    batches = packed_batches(examples)
    num_items = trained_count(batches)
    assert_same(run_steps(model, batches, num_items), run_steps(fused_copy(model), batches, num_items))


def test_tied_head_weight_gets_the_same_gradient(tiny_model_dir, examples):
    """The tiny model ties lm_head to embed_tokens: the fused path uses that very tensor, so a trained tied
    matrix gets both uses' gradients, as on the default path."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for p in model.parameters():
        p.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    batches = padded_batches(examples)[:1]
    default = run_steps(model, batches, None)
    fused = run_steps(fused_copy(model), batches, None)
    assert list(default[1]) == ["model.embed_tokens.weight"]
    assert_loss_and_tensor_close(default, fused)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_trainable_token_rows_get_the_same_gradient(tiny_model_dir, foreign_base_dir, examples, tied):
    """model.new_tokens: peft's trainable tokens wrap the head (its own rows, or tied to the embedding's); the
    fused path computes with the wrapper's weight, the head's with the trained rows put in, so the rows and
    LoRA get the same gradients as on the default path."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from qlora_train.train.model import fit_embeddings, trainable_token_indices

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir if tied else foreign_base_dir, dtype=torch.float32)
    new = [151669, 151670]
    fit_embeddings(base, 151671, {new[0]: [27, 91], new[1]: [29]})
    indices = trainable_token_indices(base, new)
    assert indices == (new if tied else {"embed_tokens": new, "lm_head": new})
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                            init_lora_weights=False, trainable_token_indices=indices,
                                            task_type="CAUSAL_LM"))
    batch = padded_batches(examples)[0]
    trained = (batch["labels"] != IGNORE_INDEX).nonzero()
    batch["input_ids"][0, 1] = new[0]  # read and written: both rows get gradients in both matrices
    batch["labels"][tuple(trained[:4].t())] = torch.tensor([new[1], new[0], new[1], new[1]])
    default, fused = run_steps(model, [batch], None), run_steps(fused_copy(model), [batch], None)
    rows = [n for n in default[1] if "trainable_tokens" in n]
    assert len(rows) == (1 if tied else 2) and all(default[1][n].norm() > 0 for n in rows)
    assert_loss_and_tensor_close(default, fused)


def assert_loss_and_tensor_close(default, fused):
    (d_losses, d_grads), (f_losses, f_grads) = default, fused
    assert abs(f_losses[0] - d_losses[0]) <= REL * abs(d_losses[0])
    for name, d in d_grads.items():
        assert (f_grads[name] - d).norm() <= REL * d.norm(), name


class LargestLogits(TorchDispatchMode):
    """Records the most rows of any new tensor (not a view of an input) an op makes whose last dimension
    is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == VOCAB
                    and t.untyped_storage().data_ptr() not in inputs):
                self.rows = max(self.rows, t.numel() // VOCAB)
        return out


def test_at_most_one_chunk_of_logits_exists(lora_model, examples):
    batch = padded_batches(examples)[0]
    positions = batch["input_ids"].numel()
    trained = int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())
    assert trained > 3 * CHUNK
    default, fused = LargestLogits(), LargestLogits()
    with default:
        lora_model(**batch).loss.backward()
    with fused:
        fused_copy(lora_model)(**batch).loss.backward()
    assert default.rows == positions  # the check sees the default path's full logits
    assert fused.rows == CHUNK


def test_eval_without_grad_gives_the_same_loss_and_no_logits(lora_model, examples):
    batch = packed_batches(examples)[0]
    fused = fused_copy(lora_model)
    with torch.no_grad():
        want = lora_model(**batch).loss
        out = fused(**batch)
        alone = fused(input_ids=batch["input_ids"][:, :8])  # without labels: the model's own forward
    assert out.logits is None and not out.loss.requires_grad
    assert abs(out.loss.item() - want.item()) <= REL * want.item()
    assert alone.logits.shape == (len(batch["input_ids"]), 8, VOCAB)


def test_causal_lm_loss_matches_cross_entropy_on_a_small_vocabulary():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :3] = IGNORE_INDEX
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    for num_items in (None, torch.tensor(23)):
        logits = (hidden @ weight.T).reshape(-1, 50)
        if num_items is None:
            want = torch.nn.functional.cross_entropy(logits, shifted)
        else:
            want = torch.nn.functional.cross_entropy(logits, shifted, reduction="sum") / num_items
        got = causal_lm_loss(hidden, weight, labels, num_items_in_batch=num_items, chunk_tokens=4)
        assert torch.allclose(got, want, rtol=1e-6)
        got_grads = torch.autograd.grad(got * 3, (hidden, weight))
        for g, w in zip(got_grads, torch.autograd.grad(want * 3, (hidden, weight))):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-7)


# --- fallbacks -----------------------------------------------------------------------------------------------


def tiny(config_cls, model_cls, **extra):
    config = config_cls(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, **extra)
    return model_cls(config)


def test_softcapping_on_the_config_falls_back(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.final_logit_softcapping = 30.0
    note = use_fused_loss(model, True)
    assert note == ("loss: the model's own, over all logits (fused loss off: config.final_logit_softcapping = 30.0 "
                    "changes the logits after the head)")
    assert not uses_fused_loss(model) and "forward" not in vars(model)


@pytest.mark.parametrize("arch, reason", [
    ("Gemma2", "config.final_logit_softcapping = 30.0 changes the logits after the head"),
    ("Cohere", "config.logit_scale = 0.0625 changes the logits after the head"),
    ("Granite", "config.logits_scaling = 1.0 changes the logits after the head"),
])
def test_models_that_scale_their_logits_fall_back(arch, reason):
    import transformers

    model = tiny(getattr(transformers, f"{arch}Config"), getattr(transformers, f"{arch}ForCausalLM"))
    assert fused_loss_blocker(model) == reason
    assert not uses_fused_loss(model) and use_fused_loss(model, True).endswith(f"(fused loss off: {reason})")


def test_forward_source_check():
    import transformers

    for name in ("Qwen3", "Qwen2", "Llama", "Mistral"):
        assert forward_blocker(getattr(transformers, f"{name}ForCausalLM")) is None, name
    assert forward_blocker(transformers.Gemma2ForCausalLM) == (
        "Gemma2ForCausalLM.forward changes the logits between the decoder and the loss: "
        "`logits = logits / self.config.final_logit_softcapping`")
    assert forward_blocker(transformers.FalconH1ForCausalLM) == (
        "FalconH1ForCausalLM.forward changes the logits between the decoder and the loss: "
        "`logits = self.lm_head(hidden_states) * self.model.lm_head_multiplier`")
    assert forward_blocker(transformers.Qwen3MoeForCausalLM).startswith(
        "Qwen3MoeForCausalLM.forward changes the loss between the decoder and the loss: `loss += ")
    assert forward_blocker(transformers.GPT2LMHeadModel) == "GPT2LMHeadModel.forward calls no decoder `self.model`"


def test_a_head_that_is_not_a_plain_linear_falls_back(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM"))
    assert use_fused_loss(model, True).endswith(
        "(fused loss off: the output head is a peft.tuners.lora.layer.Linear, not a plain torch.nn.Linear)")
    assert not uses_fused_loss(model)


def test_switched_off_by_the_config(lora_model):
    model = copy.deepcopy(lora_model)
    assert use_fused_loss(model, False) == "loss: the model's own, over all logits (fused loss off: " \
                                           "train.fused_loss: false)"
    assert not uses_fused_loss(model)


def test_the_documented_chunk_size_is_the_one_used():
    from qlora_train.config import TrainConfig

    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text().split())
    assert CHUNK_TOKENS == 1024
    assert "1,024" in TrainConfig.model_fields["fused_loss"].description and "1,024 trained tokens" in docs


def test_the_fused_forward_reads_no_deprecated_output_name(lora_model, examples):
    """transformers 5.2x renamed ``past_key_values`` to ``cache`` and warns on the old name: the fused forward
    reads the name this version has (the warning printed once per run, from our code, not the user's)."""
    import logging

    from transformers.utils import logging as hf_logging

    class Seen(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    seen, root = Seen(), logging.getLogger("transformers")
    hf_logging.warning_once.cache_clear()  # said once per process: the test must not miss it for an earlier one
    root.addHandler(seen)
    try:
        with torch.no_grad():
            fused_copy(lora_model)(**packed_batches(examples)[0])
    finally:
        root.removeHandler(seen)
    assert [m for m in seen.messages if "deprecated" in m] == []
