"""model.new_tokens in training: embeddings grown for the template's markers, each new row started as the mean
of its pieces' rows, only those rows trained (peft's trainable tokens) besides LoRA, in the embedding and in an
untied output head; every other row bit-identical to the base; saved with the adapter, without whole matrices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import TrainerCallback

from qlora_train.config import load_config
from qlora_train.tokenizer import load_tokenizer
from qlora_train.train.run import train

from ..conftest import FOREIGN_MARKERS

pytestmark = pytest.mark.slow
QWEN_TOKENS = 151669  # the tokenizer's length: the untied base has exactly these rows, the tied one 151,936
ROWS = [{"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Hi again!"}]}] * 4


def write_config(tmp_path, model_dir, template, **train) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = {
        "model": {"name_or_path": str(model_dir), "chat_template": str(template), "new_tokens": "auto"},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"datasets": [{"path": str(tmp_path / "rows.jsonl")}], "max_length": 64},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 3, "per_device_train_batch_size": 4,
                  "learning_rate": 1e-2, "lr_scheduler": "constant", "warmup_ratio": 0.0, "save_steps": 2,
                  "logging_steps": 1, "report_to": "none", "gradient_checkpointing": False, **train},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "cfg.yaml")


class EmbeddingSnapshot(TrainerCallback):
    """The embedding and output head as the model computes with them (trained rows put in), at train begin and
    end, and which parameters train."""

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        self.before = self.matrices(model)

    def on_train_end(self, args, state, control, model=None, **kw):
        self.after = self.matrices(model)

    @staticmethod
    def matrices(model) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {"embedding": model.get_input_embeddings().weight.detach().clone(),
                    "head": model.get_output_embeddings().weight.detach().clone()}


def base_matrices(model_dir) -> dict[str, torch.Tensor]:
    weights = load_file(model_dir / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    return {"embedding": embedding, "head": weights.get("lm_head.weight", embedding)}


@pytest.fixture(scope="module")
def untied_run(tmp_path_factory, foreign_base_dir, foreign_template):
    """Three steps on the untied base with no spare rows: the embeddings must grow."""
    path = write_config(tmp_path_factory.mktemp("untied"), foreign_base_dir, foreign_template)
    snap = EmbeddingSnapshot()
    trainer = train(load_config(path), callbacks=[snap])
    return path, trainer, snap


def test_new_rows_train_and_every_other_row_stays_the_base(untied_run, foreign_base_dir):
    path, trainer, snap = untied_run
    tok = trainer.processing_class
    new_ids = [tok.convert_tokens_to_ids(t) for t in FOREIGN_MARKERS]
    assert new_ids == [QWEN_TOKENS, QWEN_TOKENS + 1]
    plain = load_tokenizer(load_config(path).model.model_copy(update={"new_tokens": None}))
    pieces = [plain.encode(marker, add_special_tokens=False) for marker in FOREIGN_MARKERS]
    assert [len(p) for p in pieces] == [6, 6]
    base = base_matrices(foreign_base_dir)
    assert not torch.equal(base["embedding"], base["head"])  # untied
    for name, weight in base.items():
        before, after = snap.before[name], snap.after[name]
        assert before.shape == after.shape == (QWEN_TOKENS + 11, 64)  # grown to a multiple of 64: 151,680
        assert torch.equal(after[:QWEN_TOKENS], weight.float()), name  # bit-identical to the base
        for i, marker, ids in zip(new_ids, FOREIGN_MARKERS, pieces):
            start = weight[ids].float().mean(dim=0)  # the mean of the rows of the pieces it was before
            torch.testing.assert_close(before[i], start, rtol=0, atol=1e-6, msg=f"{name} {marker}")
            assert not torch.equal(after[i], before[i]), f"{name} row of {marker} did not train"
        padding = weight.float().mean(dim=0).expand(9, -1)
        assert torch.equal(before[QWEN_TOKENS + 2:], after[QWEN_TOKENS + 2:])  # padding rows: not trained
        torch.testing.assert_close(after[QWEN_TOKENS + 2:], padding, rtol=0, atol=1e-6)
    trained_rows = [n for n in snap.trainable if "lora_" not in n]
    assert trained_rows == ["base_model.model.lm_head.token_adapter.trainable_tokens_delta.default",
                            "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"]


def test_the_adapter_holds_the_new_rows_not_whole_matrices(untied_run):
    path, trainer, snap = untied_run
    out = load_config(path).train.output_dir
    for folder in (out, f"{out}/checkpoint-2"):
        weights = load_file(f"{folder}/adapter_model.safetensors")
        rows = {k: v.shape for k, v in weights.items() if "lora_" not in k}
        assert rows == {"base_model.model.lm_head.token_adapter.trainable_tokens_delta": (2, 64),
                        "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": (2, 64)}
        config = json.loads(Path(folder, "adapter_config.json").read_text())
        assert config["trainable_token_indices"] == {"embed_tokens": [QWEN_TOKENS, QWEN_TOKENS + 1],
                                                     "lm_head": [QWEN_TOKENS, QWEN_TOKENS + 1]}
    delta = load_file(f"{out}/adapter_model.safetensors")
    key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    assert torch.equal(delta[key], snap.after["embedding"][QWEN_TOKENS:QWEN_TOKENS + 2])


def test_the_saved_adapter_and_tokenizer_reload_to_the_trained_model(untied_run):
    from peft import PeftModel
    from transformers import AutoTokenizer

    from qlora_train.export.adapter import fit_base_to_adapter
    from qlora_train.train.model import load_base_model, resolve_runtime

    path, trainer, _ = untied_run
    cfg = load_config(path)
    out = cfg.train.output_dir
    tok = AutoTokenizer.from_pretrained(out)
    assert [tok.convert_tokens_to_ids(t) for t in FOREIGN_MARKERS] == [QWEN_TOKENS, QWEN_TOKENS + 1]
    base = load_base_model(cfg.model, resolve_runtime(cfg))
    fit_base_to_adapter(base, Path(out), tok)
    reloaded = PeftModel.from_pretrained(base, out)
    text = tok.apply_chat_template(ROWS[0]["messages"], tokenize=False)
    inputs = tok(text, add_special_tokens=False, return_tensors="pt")
    assert QWEN_TOKENS + 1 in inputs["input_ids"][0].tolist()
    # train mode (dropout is 0): bitsandbytes dequantises as in training
    trained, reloaded = trainer.model.train(), reloaded.train()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, trained(**inputs).logits, rtol=0, atol=1e-5)


def test_tied_base_with_spare_rows_trains_only_the_new_rows(tmp_path, tiny_model_dir, foreign_template):
    """The tiny Qwen3 ties its head to the embedding and has 151,936 rows: no growing, one matrix, and peft
    trains the head's new rows through the embedding's."""
    snap = EmbeddingSnapshot()
    train(load_config(write_config(tmp_path, tiny_model_dir, foreign_template, max_steps=2, save_steps=10)),
          callbacks=[snap])
    base = base_matrices(tiny_model_dir)["embedding"].float()
    after = snap.after["embedding"]
    assert after.shape == base.shape == (151936, 64)
    assert torch.equal(snap.after["head"], after)  # tied: the head computes with the trained rows too
    changed = (after != base).any(dim=1).nonzero().flatten().tolist()
    assert changed == [QWEN_TOKENS, QWEN_TOKENS + 1]
    assert [n for n in snap.trainable if "lora_" not in n] == [
        "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"]
