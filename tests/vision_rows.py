"""Helpers of the vision-language tests: drawn images, processed rows made by hand (canonical messages with image
slots, masked by the engine), and a config for the tiny Qwen2.5-VL."""

from __future__ import annotations

from pathlib import Path

import yaml

IMAGE_TOKEN_ID = 151655  # <|image_pad|> in the Qwen vocabulary
# name -> (width, height, colour); 56x56 makes 4 image tokens with the tiny model's processor, 112x84 12, 84x56 6
IMAGES = {"red": (56, 56, (220, 30, 30)), "blue": (112, 84, (30, 60, 220)), "green": (84, 56, (30, 170, 60))}


def write_images(folder: Path) -> dict[str, dict]:
    """Draw ``IMAGES`` into ``folder`` -> name -> its ``ImageInfo`` (absolute path, size)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (w, h, colour) in IMAGES.items():
        path = folder / f"{name}.png"
        Image.new("RGB", (w, h), colour).save(path)
        out[name] = {"ref": str(path), "width": w, "height": h}
    return out


def conversation(images: list[dict], question: str, answer: str) -> list[dict]:
    """A user turn with ``images`` before ``question`` (canonical messages: an image slot each), then the trained
    answer."""
    from qlora_train.masking import IMAGE_SLOT

    user = {"role": "user", "content": IMAGE_SLOT * len(images) + question, "train": False}
    if images:
        user["images"] = images
    return [user, {"role": "assistant", "content": answer, "train": True}]


def processed_rows(tokenizer, infos: dict[str, dict]) -> list[dict]:
    """Processed SFT rows as the pipeline feeds the model (``input_ids``, ``attention_mask``, ``labels``,
    ``images``), made by ``mask_conversation`` with the tokenizer's image rule: 0, 1 and 2 images a row."""
    from qlora_train.masking import mask_conversation, message_images

    specs = [(["red"], "What colour is this?", "It is red."),
             (["blue", "green"], "Which colours?", "Blue, then green."),
             ([], "Name a colour.", "Green."), (["green"], "What colour is this?", "It is green."),
             (["blue"], "What colour is this?", "It is blue."), (["red", "red"], "Same?", "Yes, both red.")]
    rows = []
    for names, question, answer in specs:
        messages = conversation([infos[n] for n in names], question, answer)
        example = mask_conversation(messages, tokenizer).example(max_length=None, truncate_side="right")
        rows.append({"input_ids": example["input_ids"], "attention_mask": example["attention_mask"],
                     "labels": example["labels"], "images": [im["ref"] for im in message_images(messages)]})
    return rows


def write_vl_config(tmp_path: Path, model_dir, data_path: Path | None = None, max_samples: int | None = None,
                    **train) -> Path:
    """A config for the tiny Qwen2.5-VL (4-bit + LoRA r=4, a few steps), its data ``data_path`` (its first
    ``max_samples`` rows), or a stand-in path: the tests that feed rows by hand replace the data."""
    if data_path is None:
        data_path = tmp_path / "rows.jsonl"
        data_path.write_text('{"messages": [{"role": "user", "content": "Hi"}, '
                             '{"role": "assistant", "content": "Hello."}]}\n')
    cfg = {
        "model": {"name_or_path": str(model_dir), "load_in_4bit": True},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"datasets": [{"path": str(data_path), **({"max_samples": max_samples} if max_samples else {})}],
                 "max_length": 256},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 4, "per_device_train_batch_size": 3,
                  "learning_rate": 2e-2, "save_steps": 100, "logging_steps": 1, "report_to": "none",
                  "lr_scheduler": "constant", "warmup_ratio": 0.0, **train},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def feed_rows(monkeypatch, rows: list[dict]) -> None:
    """Make ``train()`` feed ``rows`` (a ``datasets.Dataset`` of them, no eval split) instead of reading the
    config's data."""
    import datasets

    from qlora_train.data.dataset import DatasetReport
    from qlora_train.data.prepared import TrainingData
    from qlora_train.train import run

    report = DatasetReport(rows_in=len(rows), rows_kept=len(rows), train_rows=len(rows))
    monkeypatch.setattr(run, "training_data",
                        lambda cfg, tok: TrainingData(datasets.Dataset.from_list(rows), None, report))


def sizes_of(msgs) -> list[tuple[int, int]]:
    """The (width, height) of every image in ``msgs``, in order."""
    return [(im["width"], im["height"]) for m in msgs for im in m.get("images", ())]


def pictures(sizes):
    """Plain images of ``sizes`` (each its own colour), or None for none: what a processor is given."""
    from PIL import Image

    return [Image.new("RGB", s, (40 * k % 255, 90, 200)) for k, s in enumerate(sizes)] or None


def rule_of_folder(folder: Path, family: str, config: dict, tok, processor_config: dict | None = None):
    """The image rule (``vision.image_rule_for``) of a model folder holding ``config`` as its ``config.json``, the
    family's tiny image processor and, when given, ``processor_config`` as its ``processor_config.json``."""
    import json

    from qlora_train.config import ModelConfig
    from qlora_train.tiny import tiny_image_processor
    from qlora_train.vision import image_rule_for

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    tiny_image_processor(family).save_pretrained(folder)
    if processor_config is not None:
        (folder / "processor_config.json").write_text(json.dumps(processor_config))
    return image_rule_for(ModelConfig(name_or_path=str(folder)), tok)


def packing_problem(folder: Path, config: dict) -> str:
    """The one problem ``vision.check_vision_training`` finds in a packed run of a model with ``config``."""
    import pytest

    from qlora_train.errors import ConfigError
    from qlora_train.vision import check_vision_training, vision_base
    from tests.train.test_vision import config_for

    cfg = config_for(folder, config, "train.packing=true")
    with pytest.raises(ConfigError) as exc:
        check_vision_training(cfg, vision_base(cfg.model))
    (problem,) = exc.value.problems
    return problem


def processor_output(proc, text: str, sizes: list[tuple[int, int]], **kwargs) -> dict:
    """A processor's own output for ``text`` (its images written as the processor takes them) and images of
    ``sizes``, no special tokens added (the render holds its own): ``input_ids`` as a list, the rest as returned."""
    out = proc(text=[text], images=pictures(sizes), add_special_tokens=False, **kwargs)
    return {"input_ids": out["input_ids"][0].tolist(), **{k: v for k, v in out.items() if k != "input_ids"}}
