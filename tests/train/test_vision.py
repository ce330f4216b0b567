"""Vision-language training: the image collator (pixels, grids, the per-row token check), what a vision-language
base refuses, and on the tiny Qwen2.5-VL the real QLoRA path (language model 4-bit, vision tower not, frozen)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from qlora_train.config import load_config
from qlora_train.errors import ConfigError, DataError
from qlora_train.masking import IGNORE_INDEX, ImageRule
from qlora_train.train.collator import ImageCollator, PadCollator
from qlora_train.vision import VisionBase, check_images_readable, check_vision_training, vision_base
from tests.vision_rows import IMAGE_TOKEN_ID, feed_rows, processed_rows, write_images, write_vl_config

DEMO_ROWS = Path(__file__).resolve().parents[2] / "configs" / "data" / "quickstart-vl.jsonl"
DEMO_PAIRS = DEMO_ROWS.with_name("quickstart-vl-dpo.jsonl")  # RLAIF-V's layout: image, question, chosen, rejected


@pytest.fixture(scope="module")
def image_rule():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from qlora_train.tiny import TINY_VL_MAX_PIXELS, TINY_VL_MIN_PIXELS

    processor = Qwen2VLImageProcessorPil(min_pixels=TINY_VL_MIN_PIXELS, max_pixels=TINY_VL_MAX_PIXELS)
    return ImageRule("<|image_pad|>", IMAGE_TOKEN_ID, processor)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"))


def row(ids: list[int], refs: list[str]) -> dict:
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [IGNORE_INDEX] * (len(ids) - 1) + [9],
            "images": refs}


IMG = IMAGE_TOKEN_ID


def test_image_collator_pixels_grids_and_token_types(image_rule, images):
    red, blue = images["red"]["ref"], images["blue"]["ref"]  # 56x56: 4 tokens; 112x84: 12
    rows = [row([1, 2, *[IMG] * 4, 3], [red]), row([4, 5, 6], []), row([7, *[IMG] * 4, *[IMG] * 12, 8], [red, blue])]
    batch = ImageCollator(0, image_rule)(rows)
    padded = PadCollator(0)(rows)
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(batch[key], padded[key])
    # one [t, h, w] grid of 14-pixel patches per image, in row order: 56/14 = 4; 84/14 = 6 high, 112/14 = 8 wide
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4], [1, 6, 8]]
    assert batch["pixel_values"].shape == (16 + 16 + 48, 3 * 2 * 14 * 14)  # patches x (channels, time, 14, 14)
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == IMG).int())
    assert batch["mm_token_type_ids"].sum(dim=1).tolist() == [4, 0, 16]


def test_image_collator_reads_one_image_at_a_time_with_the_pixels_of_one_call(image_rule, images, monkeypatch):
    """Each image decoded and processed alone (a batch holds one decoded image at a time): the same pixels and grids
    as the processor's one call on all of them."""
    from PIL import Image

    from qlora_train.data.images import open_image

    red, blue, green = (images[k]["ref"] for k in ("red", "blue", "green"))
    rows = [row([1, *[IMG] * 4, 3], [red]), row([7, *[IMG] * 12, *[IMG] * 6, 8], [blue, green])]
    calls = []
    real = type(image_rule.image_processor).__call__
    monkeypatch.setattr(type(image_rule.image_processor), "__call__",
                        lambda self, images, **kw: calls.append(len(images)) or real(self, images=images, **kw))
    batch = ImageCollator(0, image_rule)(rows)
    assert calls == [1, 1, 1]
    whole = real(image_rule.image_processor, images=[open_image(r) for r in (red, blue, green)], return_tensors="pt")
    assert torch.equal(batch["pixel_values"], whole["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], whole["image_grid_thw"])
    with Image.open(red) as im:
        assert open_image(red).tobytes() == im.convert("RGB").tobytes()


def test_pair_collator_feeds_both_sides_the_prompts_images(image_rule, images):
    """A pair's images (its prompt's) go with its chosen row and its rejected row: the chosen rows' pixels, then the
    rejected rows'; each side's image tokens checked against them."""
    from qlora_train.train.collator import PairCollator

    red, blue = images["red"]["ref"], images["blue"]["ref"]  # 4 and 12 tokens
    pairs = [{"chosen_input_ids": [1, *[IMG] * 4, 2, 3], "chosen_labels": [IGNORE_INDEX] * 6 + [3],
              "rejected_input_ids": [1, *[IMG] * 4, 2, 4, 5], "rejected_labels": [IGNORE_INDEX] * 6 + [4, 5],
              "images": [red]},
             {"chosen_input_ids": [1, *[IMG] * 12, 6], "chosen_labels": [IGNORE_INDEX] * 13 + [6],
              "rejected_input_ids": [1, *[IMG] * 12, 7], "rejected_labels": [IGNORE_INDEX] * 13 + [7],
              "images": [blue]}]
    batch = PairCollator(0, rule=image_rule)(pairs)
    plain = PairCollator(0)(pairs)
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(batch[key], plain[key])
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]] * 2  # chosen rows' images, then rejected's
    assert batch["mm_token_type_ids"].sum(dim=1).tolist() == [4, 12, 4, 12]
    assert set(plain) == {"input_ids", "attention_mask", "labels"}  # a text model's pairs: no pixel inputs
    broken = [dict(pairs[0], rejected_input_ids=[1, *[IMG] * 3, 2, 4, 5, 5])]
    with pytest.raises(DataError, match="batch row 1: its ids hold 3 image tokens"):
        PairCollator(0, rule=image_rule)(broken)


def test_image_collator_text_batch_is_pad_collators(image_rule):
    rows = [row([1, 2, 3], []), row([4, 5], [])]
    batch = ImageCollator(0, image_rule)(rows)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].tolist() == PadCollator(0)(rows)["input_ids"].tolist()


def test_image_collator_refuses_a_row_whose_tokens_disagree(image_rule, images):
    red = images["red"]["ref"]
    broken = row([1, *[IMG] * 3, 2], [red])  # a 56x56 image makes 4 tokens, the ids hold 3
    with pytest.raises(DataError, match=r"batch row 1: its ids hold 3 image tokens .* make 4 \(.*red.png 56x56"):
        ImageCollator(0, image_rule)([row([1, *[IMG] * 4, 2], [red]), broken])
    swapped = row([1, *[IMG] * 4, 2], [images["blue"]["ref"]])  # another image than the ids were made for
    with pytest.raises(DataError, match="batch row 0: its ids hold 4 image tokens .* make 12"):
        ImageCollator(0, image_rule)([swapped])


def test_image_collator_names_an_image_gone_since(image_rule, tmp_path):
    with pytest.raises(DataError, match=r"batch row 0: cannot read its image .*gone\.png"):
        ImageCollator(0, image_rule)([row([1, *[IMG] * 4], [str(tmp_path / "gone.png")])])


def write_model_config(folder, config: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_vision_base_reads_the_config(tmp_path):
    from qlora_train.config import ModelConfig

    def base(config):
        return vision_base(ModelConfig(name_or_path=str(write_model_config(tmp_path / "m", config))))

    assert base({"model_type": "qwen3"}) is None
    assert base({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}) == VisionBase("qwen2_5_vl",
                                                                                            "model.visual")
    assert base({"model_type": "qwen3_vl", "vision_config": {"depth": 2}}).supported
    assert base({"model_type": "gemma3", "vision_config": {"hidden_size": 8}}) == VisionBase("gemma3",
                                                                                              "model.vision_tower")
    assert base({"model_type": "llava_onevision", "vision_config": {"hidden_size": 8}}) == VisionBase(
        "llava_onevision", "model.vision_tower")
    pali = base({"model_type": "paligemma", "vision_config": {"hidden_size": 8}})
    assert pali == VisionBase("paligemma", None) and not pali.supported


def config_for(tmp_path, config: dict, *overrides: str):
    model = write_model_config(tmp_path / "model", config)
    return load_config(write_vl_config(tmp_path, model), list(overrides))


QWEN_VL = {"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}


GRPO = ("train.method=grpo", "rl.max_completion_length=64",
        "rl.rewards=[{function: 'qlora_train.rl.rewards:matches', kwargs: {pattern: 'yes'}}]")


@pytest.mark.parametrize("overrides, key", [
    (GRPO, "data.objective"),
    (("train.distributed=fsdp",), "train.distributed"),
])
def test_vision_base_refuses_what_it_cannot_train(tmp_path, overrides, key):
    cfg = config_for(tmp_path, QWEN_VL, *overrides)
    with pytest.raises(ConfigError) as exc:
        check_vision_training(cfg, vision_base(cfg.model))
    assert len(exc.value.problems) == 1 and exc.value.problems[0].startswith(f"{key}: ")
    assert "qwen2_5_vl" in exc.value.problems[0]


def test_packed_image_rows_refuse_flash_attention(tmp_path, image_rule):
    """Packing image rows needs the 4D block mask: flash-attention's packed form reads 1D positions."""
    from types import SimpleNamespace

    from qlora_train.masking import set_image_rule
    from qlora_train.train.run import make_collator

    cfg = config_for(tmp_path, QWEN_VL, "train.packing=true")
    tokenizer = set_image_rule(SimpleNamespace(pad_token_id=0), image_rule)
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(ConfigError, match="train.packing: packed image rows need a 4D block mask"):
        make_collator(cfg, tokenizer, model, SimpleNamespace(device="cuda"))
    check_vision_training(cfg, vision_base(cfg.model))  # packing itself is not refused


def test_train_vision_needs_a_vision_tower(tmp_path):
    cfg = config_for(tmp_path, {"model_type": "qwen3"}, "lora.train_vision=true")
    with pytest.raises(ConfigError, match="lora.train_vision: .* is a text-only model"):
        check_vision_training(cfg, vision_base(cfg.model))
    plain = config_for(tmp_path / "b", QWEN_VL)
    check_vision_training(plain, vision_base(plain.model))  # nothing refused


def test_image_rows_of_an_unsupported_vision_base_are_a_config_error(tmp_path):
    cfg = config_for(tmp_path, {"model_type": "paligemma", "vision_config": {"hidden_size": 8}})
    base = vision_base(cfg.model)
    with pytest.raises(ConfigError, match=re.escape("is a paligemma vision-language model; this trainer reads "
                                                    "images for qwen2-vl (qwen2_vl), qwen2.5-vl (qwen2_5_vl), "
                                                    "qwen3-vl (qwen3_vl), gemma3 (gemma3), mistral3 (mistral3), "
                                                    "idefics3 (idefics3), internvl3 (internvl), "
                                                    "llava-onevision (llava_onevision) only")):
        check_images_readable(cfg.model, base, 3)
    check_images_readable(cfg.model, base, 0)  # text rows: it trains on them
    check_images_readable(cfg.model, None, 3)  # a text model: counted drops


@pytest.mark.parametrize("override, key", [
    ("data.image_dir=/data/images", "data.image_dir"),
    ("data.image_root=/data", "data.image_root"),
    ("lora.train_vision=true", "lora.train_vision"),
])
def test_an_unsupported_family_asked_for_images_is_refused_at_config_time(tmp_path, override, key):
    """PaliGemma (not a family whose images are read) asked for images: one config error naming the key and
    the supported families, before any data loads; its text rows alone still train (no such key set)."""
    pali = {"model_type": "paligemma", "vision_config": {"hidden_size": 8}}
    cfg = config_for(tmp_path, pali, override)
    with pytest.raises(ConfigError) as exc:
        check_vision_training(cfg, vision_base(cfg.model))
    (problem,) = exc.value.problems
    assert problem.startswith(f"{key}: ") and "paligemma" in problem
    assert ("qwen2-vl (qwen2_vl), qwen2.5-vl (qwen2_5_vl), qwen3-vl (qwen3_vl), gemma3 (gemma3), "
            "mistral3 (mistral3), idefics3 (idefics3), internvl3 (internvl), llava-onevision (llava_onevision)"
            ) in problem
    plain = config_for(tmp_path / "b", pali)
    check_vision_training(plain, vision_base(plain.model))


GEMMA3 = {"model_type": "gemma3", "vision_config": {"hidden_size": 8}, "mm_tokens_per_image": 4}


def test_gemma3_packing_is_refused_at_config_time_with_the_reason(tmp_path):
    cfg = config_for(tmp_path, GEMMA3, "train.packing=true")
    with pytest.raises(ConfigError) as exc:
        check_vision_training(cfg, vision_base(cfg.model))
    (problem,) = exc.value.problems
    assert problem.startswith("train.packing: packed image rows are not supported for ") and "(gemma3)" in problem
    assert "token_type_ids" in problem and "supported for qwen2-vl, qwen2.5-vl, qwen3-vl;" in problem
    plain = config_for(tmp_path / "b", GEMMA3)
    check_vision_training(plain, vision_base(plain.model))  # unpacked: nothing refused


def test_llava_onevision_packing_is_refused_at_config_time_with_the_reason(tmp_path):
    cfg = config_for(tmp_path, {"model_type": "llava_onevision", "vision_config": {"hidden_size": 8}},
                     "train.packing=true")
    with pytest.raises(ConfigError) as exc:
        check_vision_training(cfg, vision_base(cfg.model))
    (problem,) = exc.value.problems
    assert "(llava_onevision)" in problem and "image_sizes" in problem and "not proved" in problem


def test_gemma3_rule_counts_the_models_tokens_and_its_processor_must_agree(tmp_path):
    """``image_rule_for`` a Gemma 3 base: the placeholder, the wrapper and ``mm_tokens_per_image`` an image; a
    saved processor writing another count (``image_seq_length``) is a ``ModelLoadError`` naming both."""
    from types import SimpleNamespace

    from qlora_train.config import ModelConfig
    from qlora_train.errors import ModelLoadError
    from qlora_train.tiny import tiny_image_processor
    from qlora_train.vision import image_rule_for

    folder = write_model_config(tmp_path / "g", GEMMA3)
    tiny_image_processor("gemma3").save_pretrained(folder)
    added = {"<start_of_image>": 255999, "<image_soft_token>": 262144, "<end_of_image>": 256000}
    tok = SimpleNamespace(get_added_vocab=lambda: added, convert_tokens_to_ids=added.__getitem__)
    cfg = ModelConfig(name_or_path=str(folder))
    rule = image_rule_for(cfg, tok)
    assert (rule.written, rule.image_token_id, rule.fixed_tokens, rule.type_ids) == (
        "<start_of_image>", 262144, 4, "token_type_ids")
    assert rule.expansion(2) == "\n\n<start_of_image><image_soft_token><image_soft_token><end_of_image>\n\n"
    assert rule.tokens(8, 700) == rule.tokens(900, 900) == 4 and rule.other_tokens == ("<end_of_image>",)
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": 256}))
    with pytest.raises(ModelLoadError, match="image_seq_length 256 differs from the model config's "
                                             "mm_tokens_per_image 4"):
        image_rule_for(cfg, tok)
    processor = tiny_image_processor("gemma3")
    processor.do_pan_and_scan = True  # its crops: more image sequences, by the image's shape
    processor.save_pretrained(folder)
    with pytest.raises(ModelLoadError, match="do_pan_and_scan: true"):
        image_rule_for(cfg, tok)


def test_family_registry_names_each_family_once():
    from qlora_train.chat_templates import resolve_chat_template
    from qlora_train.tiny import main
    from qlora_train.vision import FAMILIES, SUPPORTED, family_named

    assert [f.name for f in FAMILIES] == ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "gemma3", "mistral3",
                                          "idefics3", "internvl3", "llava-onevision"]
    assert SUPPORTED == {"qwen2_vl": "model.visual", "qwen2_5_vl": "model.visual", "qwen3_vl": "model.visual",
                         "gemma3": "model.vision_tower", "mistral3": "model.vision_tower",
                         "idefics3": "model.vision_model", "internvl": "model.vision_tower",
                         "llava_onevision": "model.vision_tower"}
    for f in FAMILIES:
        assert family_named(f.model_type) is family_named(f.name) is f
        written = {"gemma3": "<start_of_image>", "mistral3": "-%}[IMG]", "idefics3": "{{- '<image>' }}",
                   "internvl3": "-%}<IMG_CONTEXT>{{ '\\n' }}", "llava-onevision": "<image>"}.get(
            f.name, "<|vision_start|><|image_pad|><|vision_end|>")
        assert written in resolve_chat_template(f.chat_template)
    with pytest.raises(ValueError, match=r"unknown vision-language family 'llava': supported: qwen2-vl \(qwen2_vl\)"):
        family_named("llava")
    with pytest.raises(SystemExit):  # argparse: invalid choice, the families listed
        main(["--vision", "llava"])


# --- the tiny Qwen2.5-VL ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vl_tokenizer(tiny_vl_dir):
    from qlora_train.config import ModelConfig
    from qlora_train.tokenizer import load_tokenizer

    return load_tokenizer(ModelConfig(name_or_path=str(tiny_vl_dir)))


def test_tokenizer_of_a_vision_base_carries_its_processors_rule(vl_tokenizer, tiny_vl_dir):
    from transformers import AutoImageProcessor

    from qlora_train.masking import image_rule

    rule = image_rule(vl_tokenizer)
    assert (rule.image_token, rule.image_token_id) == ("<|image_pad|>", IMG)
    assert type(rule.image_processor) is type(AutoImageProcessor.from_pretrained(tiny_vl_dir))
    assert [rule.tokens(56, 56), rule.tokens(112, 84), rule.tokens(1000, 1000)] == [4, 12, 64]  # 4..64 an image
    assert "<|vision_start|><|image_pad|><|vision_end|>" in vl_tokenizer.chat_template  # its own: qwen2.5-vl


@pytest.mark.slow
@pytest.mark.parametrize("train_vision", [False, True])
def test_language_model_4bit_vision_tower_not_and_frozen(tiny_vl_dir, tmp_path, vl_tokenizer, train_vision):
    from qlora_train.train.model import load_model, resolve_runtime

    cfg = load_config(write_vl_config(tmp_path, tiny_vl_dir), [f"lora.train_vision={str(train_vision).lower()}"])
    model = load_model(cfg, resolve_runtime(cfg))
    modules = dict(model.get_base_model().named_modules())
    four_bit = [n for n, m in modules.items() if type(m).__name__ == "Linear4bit"]
    assert four_bit and all(n.startswith("model.language_model.") for n in four_bit)
    tower = {n: m for n, m in modules.items() if n.startswith("model.visual.")}
    assert not [n for n, m in tower.items() if type(m).__module__.startswith("bitsandbytes")]
    assert type(tower["model.visual.blocks.0.attn.qkv" + (".base_layer" if train_vision else "")]) is torch.nn.Linear
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    in_tower = [n for n in trained if ".model.visual." in n]
    assert bool(in_tower) is train_vision
    if not train_vision:
        assert all(".model.language_model." in n for n in trained)
        assert [p.dtype for n, p in model.named_parameters() if ".model.visual." in n][0] == torch.float32
    else:  # the tower's attention and MLP layers, the merger's too, and the loss reaches them
        assert any(".attn.qkv.lora_A" in n for n in in_tower) and any(".merger." in n for n in in_tower)
        rows = processed_rows(vl_tokenizer, write_images(tmp_path / "images"))
        model(**ImageCollator(vl_tokenizer.pad_token_id, vl_tokenizer.qlora_image_rule)(rows[:2])).loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if n in in_tower and "lora_B" in n}
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


@pytest.mark.slow
def test_fused_loss_equals_the_models_own_on_image_rows(tiny_vl_dir, tmp_path, vl_tokenizer):
    from qlora_train.train.fused_loss import use_fused_loss, uses_fused_loss
    from qlora_train.train.model import load_model, resolve_runtime

    cfg = load_config(write_vl_config(tmp_path, tiny_vl_dir), [])
    rows = processed_rows(vl_tokenizer, write_images(tmp_path / "images"))
    batch = ImageCollator(vl_tokenizer.pad_token_id, vl_tokenizer.qlora_image_rule)(rows[:3])
    assert batch["image_grid_thw"].shape == (3, 3)
    model = load_model(cfg, resolve_runtime(cfg))
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        use_fused_loss(model, True)
        assert uses_fused_loss(model)
        fused = model(**batch)
    assert fused.logits is None  # the head ran at trained positions only
    labels = batch["labels"][:, 1:].reshape(-1)
    own = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels)
    assert fused.loss.item() == pytest.approx(own.item(), rel=1e-5)


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.slow
def test_trains_the_bundled_image_rows_from_the_config(tiny_vl_dir, tmp_path, caplog, capsys):
    """The demo's rows (content parts, relative image paths) read, expanded, collated and trained: the real path;
    transformers' lines nobody can act on (the cache turned off for gradient checkpointing) are not said."""
    from transformers import AutoImageProcessor

    from qlora_train.cli import main

    caplog.set_level(logging.INFO, logger="qlora_train")
    path = write_vl_config(tmp_path, tiny_vl_dir, data_path=DEMO_ROWS, max_samples=12, max_steps=6)
    said = Recorder()
    logging.getLogger("transformers").addHandler(said)  # transformers' loggers do not propagate to the root's
    try:
        assert main(["--config", str(path)]) == 0
    finally:
        logging.getLogger("transformers").removeHandler(said)
    assert not [m for m in said.messages if "incompatible with gradient checkpointing" in m], said.messages
    assert any(r.getMessage().startswith("loss: fused LM head") for r in caplog.records)
    printed = capsys.readouterr().out
    assert "vision     tower model.visual (qwen2_5_vl) not quantised, in float32; frozen (lora.train_vision: false)" \
        in printed
    assert re.search(r"\ndata       images: \d+ in \d+ rows read: \d+ named in message content parts\n", printed)
    out = tmp_path / "out"
    report = json.loads((out / "dataset_report.json").read_text())
    assert report["rows_kept"] == 12 and not report["dropped"]
    losses = [h["loss"] for h in json.loads((out / "loss_history.json").read_text())]
    assert len(losses) == 6 and losses[-1] < losses[0]
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["exclude_modules"] == r"model\.visual\..*"
    saved = AutoImageProcessor.from_pretrained(out)  # beside the adapter, so that the output serves
    assert saved.to_dict()["size"] == {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}  # the tiny one's


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl"])
def test_each_family_trains_the_bundled_image_rows(family, tmp_path, vl_tok):
    """A tiny model of each other family (``tiny --vision FAMILY``: its config written in code, its template, its
    image processor) trains the demo's rows: its tower not quantised and frozen, the loss falling."""
    import copy

    from qlora_train.cli import main
    from qlora_train.data import get_chat_template
    from qlora_train.tiny import build_tiny_vl

    tokenizer = get_chat_template(copy.deepcopy(vl_tok), family)  # the Qwen vocabulary, built once a session
    model = build_tiny_vl(family, tmp_path / family, tokenizer=tokenizer)
    path = write_vl_config(tmp_path, model, data_path=DEMO_ROWS, max_samples=8, max_steps=4)
    assert main(["--config", str(path), "--set", f"model.chat_template={family}"]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "dataset_report.json").read_text())["rows_kept"] == 8
    losses = [h["loss"] for h in json.loads((out / "loss_history.json").read_text())]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert json.loads((out / "adapter_config.json").read_text())["exclude_modules"] == r"model\.visual\..*"


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    """A tiny Gemma 3 (``tiny --vision gemma3``: the real Gemma 3 vocabulary, a SigLIP tower pooled into 4 tokens
    an image, a language model of width 32), built once a module."""
    from qlora_train.tiny import build_tiny_vl

    return build_tiny_vl("gemma3", tmp_path_factory.mktemp("tiny-gemma3"), hidden_size=32)


@pytest.mark.slow
def test_gemma3_fused_loss_equals_the_models_own_on_image_rows(tiny_gemma3_dir, tmp_path):
    """Gemma 3's image rows through the collator (pixels, ``token_type_ids``) and the 4-bit model: the fused loss
    equals the model's own logits' cross-entropy."""
    from transformers import AutoTokenizer

    from qlora_train.config import ModelConfig
    from qlora_train.masking import IMAGE_SLOT, mask_conversation, set_image_rule
    from qlora_train.train.fused_loss import use_fused_loss, uses_fused_loss
    from qlora_train.train.model import load_model, resolve_runtime
    from qlora_train.vision import image_rule_for

    tok = AutoTokenizer.from_pretrained(tiny_gemma3_dir)
    set_image_rule(tok, image_rule_for(ModelConfig(name_or_path=str(tiny_gemma3_dir)), tok))
    infos = list(write_images(tmp_path / "images").values())
    features = []
    for n in (1, 2, 0):
        msgs = [{"role": "user", "content": IMAGE_SLOT * n + "What is it?", "images": infos[:n]},
                {"role": "assistant", "content": "A red circle." * (n + 1)}]
        m = mask_conversation(msgs, tok)
        features.append({"input_ids": m.input_ids, "labels": m.labels, "images": [i["ref"] for i in infos[:n]]})
    batch = ImageCollator(tok.pad_token_id, tok.qlora_image_rule)(features)
    assert batch["token_type_ids"].sum().item() == 3 * 4 and "image_grid_thw" not in batch
    cfg = load_config(write_vl_config(tmp_path, tiny_gemma3_dir), ["model.chat_template=gemma3"])
    model = load_model(cfg, resolve_runtime(cfg))
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        use_fused_loss(model, True)
        assert uses_fused_loss(model)
        fused = model(**batch)
    labels = batch["labels"][:, 1:].reshape(-1)
    own = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels)
    assert fused.loss.item() == pytest.approx(own.item(), rel=1e-5)


@pytest.mark.slow
def test_gemma3_trains_the_bundled_image_rows(tiny_gemma3_dir, tmp_path):
    """A tiny Gemma 3 trains the demo's rows with the gemma3 template: its tower not quantised and frozen (no LoRA
    on ``model.vision_tower``), ``token_type_ids`` fed, the loss falling."""
    from qlora_train.cli import main

    path = write_vl_config(tmp_path, tiny_gemma3_dir, data_path=DEMO_ROWS, max_samples=8, max_steps=4)
    assert main(["--config", str(path), "--set", "model.chat_template=gemma3"]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "dataset_report.json").read_text())["rows_kept"] == 8
    losses = [h["loss"] for h in json.loads((out / "loss_history.json").read_text())]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert json.loads((out / "adapter_config.json").read_text())["exclude_modules"] == r"model\.vision_tower\..*"


def image_pair_rows(tokenizer, n: int) -> list[dict]:
    """The first ``n`` of the DPO demo's pairs (RLAIF-V's layout, images beside them), as the pipeline feeds them."""
    from qlora_train.config import DataConfig
    from qlora_train.data.pairs import canonicalize_pair, fit_pair

    cfg = DataConfig(image_dir=str(DEMO_PAIRS.parent))
    rows = [json.loads(line) for line in DEMO_PAIRS.read_text().splitlines()[:n]]
    return [fit_pair(canonicalize_pair(r, cfg, tokenizer=tokenizer), tokenizer, max_length=256).example for r in rows]


@pytest.mark.slow
def test_pair_logps_of_image_pairs_are_the_models_own_with_its_images(tiny_vl_dir, tmp_path, vl_tokenizer):
    """The pair forward feeds the decoder the batch's pixels: each side's log-probs equal the model's own logits'
    (with the images), and differ from those of the same ids without them."""
    from qlora_train.train.collator import PairCollator
    from qlora_train.train.model import load_model, resolve_runtime
    from qlora_train.train.preference import pair_logps

    cfg = load_config(write_vl_config(tmp_path, tiny_vl_dir, method="dpo"), [])
    model = load_model(cfg, resolve_runtime(cfg))
    batch = PairCollator(vl_tokenizer.pad_token_id, rule=vl_tokenizer.qlora_image_rule)(
        image_pair_rows(vl_tokenizer, 2))
    assert batch["image_grid_thw"].shape == (4, 3)
    with torch.no_grad():
        ours = pair_logps(model, batch).sums
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        blind = pair_logps(model, {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).sums
    labels = batch["labels"][:, 1:]
    token = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    own = (token * (labels != IGNORE_INDEX)).sum(dim=1)
    assert torch.allclose(ours, own, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(ours, blind, rtol=1e-5, atol=1e-4)  # the images change what the model says


@pytest.mark.slow
def test_dpo_on_image_pairs_from_the_config_starts_at_log_2(tiny_vl_dir, tmp_path, capsys):
    """The DPO demo's rows (RLAIF-V's layout) through the real path: read, paired, collated with both sides'
    pixels, trained; a fresh adapter, so the first loss is log 2."""
    import math

    from qlora_train.cli import main

    path = write_vl_config(tmp_path, tiny_vl_dir, data_path=DEMO_PAIRS, max_samples=8, max_steps=2, method="dpo",
                           per_device_train_batch_size=2)
    assert main(["--config", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "images: 8 in 8 rows read" in printed
    out = tmp_path / "out"
    report = json.loads((out / "dataset_report.json").read_text())
    assert report["rows_kept"] == 8 and not report["dropped"]
    losses = [h["loss"] for h in json.loads((out / "loss_history.json").read_text())]
    assert len(losses) == 2 and losses[0] == pytest.approx(math.log(2), abs=1e-4)


@pytest.mark.slow
def test_packed_image_rows_give_the_unpacked_loss(tiny_vl_dir, tmp_path, vl_tokenizer):
    """Rows of 0-2 images packed (a block mask, each example's 3D positions made for it alone, its images' pixels in
    order) give the loss, and the gradient, of the same rows unpacked: no example sees another."""
    from qlora_train.data.packing import pack_examples
    from qlora_train.train.collator import PackedImageCollator
    from qlora_train.train.fused_loss import inner_causal_lm
    from qlora_train.train.model import load_model, resolve_runtime

    attn = "eager"  # (sdpa, the CPU's default: the training run below)
    cfg = load_config(write_vl_config(tmp_path, tiny_vl_dir), [f"model.attn_implementation={attn}"])
    model = load_model(cfg, resolve_runtime(cfg))
    rows = processed_rows(vl_tokenizer, write_images(tmp_path / "images"))
    rule = vl_tokenizer.qlora_image_rule
    unpacked = ImageCollator(vl_tokenizer.pad_token_id, rule)(rows)
    packed_rows = [pack_examples(rows[:4]), pack_examples(rows[4:])]  # 4 examples in a row (0, 1, 2 images), then 2
    assert packed_rows[0]["images"] == [ref for r in rows[:4] for ref in r["images"]]
    collate = PackedImageCollator(vl_tokenizer.pad_token_id, rule, inner_causal_lm(model).model.get_rope_index)
    packed = collate(packed_rows)
    assert packed["position_ids"].shape == (3, *packed["input_ids"].shape)
    assert torch.equal(packed["image_grid_thw"], unpacked["image_grid_thw"])  # the same images, in the same order
    losses, grads = [], []
    for batch in (unpacked, packed):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for n, p in model.named_parameters() if p.requires_grad]))
    assert losses[1] == pytest.approx(losses[0], abs=1e-5), losses
    assert torch.allclose(grads[1], grads[0], rtol=1e-4, atol=1e-6)

    def trained_logits(batch):  # at every trained position, in example order (the loss averages them away)
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        return logits[:, :-1][batch["labels"][:, 1:] != IGNORE_INDEX]

    # each token's logits are its own unpacked ones; 1D positions instead of the 3D ones move them by ~5e-3 on this
    # model, and a plain causal mask (examples seeing earlier ones) by ~0.3
    assert (trained_logits(packed) - trained_logits(unpacked)).abs().max() < 1e-5


@pytest.mark.slow
def test_packed_and_unpacked_training_give_the_same_first_step_loss(tiny_vl_dir, tmp_path, vl_tokenizer, monkeypatch):
    """The same four rows (0, 1 and 2 images) trained one step from the config: as one padded batch, and packed
    into one sequence (train.packing: the packed collator, its block mask and per-example 3D positions, through
    the Trainer and the fused loss): the same first loss."""
    import datasets

    from qlora_train.cli import main
    from qlora_train.data.dataset import DatasetReport
    from qlora_train.data.packing import pack_examples
    from qlora_train.data.prepared import TrainingData
    from qlora_train.train import run

    rows = processed_rows(vl_tokenizer, write_images(tmp_path / "images"))[:4]
    losses = []
    for packing, fed in ((False, rows), (True, [pack_examples(rows)])):
        report = DatasetReport(rows_in=4, rows_kept=4, train_rows=len(fed))
        monkeypatch.setattr(run, "training_data", lambda cfg, tok, fed=fed, report=report: TrainingData(
            datasets.Dataset.from_list(fed), None, report))
        out = tmp_path / f"packed-{packing}"
        out.mkdir()
        path = write_vl_config(out, tiny_vl_dir, max_steps=1, per_device_train_batch_size=len(fed),
                               packing=packing)
        assert main(["--config", str(path)]) == 0
        losses.append(json.loads((out / "out" / "loss_history.json").read_text())[0]["loss"])
    assert losses[1] == pytest.approx(losses[0], abs=1e-5), losses


@pytest.mark.slow
def test_trains_rows_made_by_hand_with_several_images(tiny_vl_dir, tmp_path, vl_tokenizer, monkeypatch):
    """Rows of 0, 1 and 2 images of three sizes, processed by the engine, fed as they are (two steps)."""
    from qlora_train.cli import main

    feed_rows(monkeypatch, processed_rows(vl_tokenizer, write_images(tmp_path / "images")))
    assert main(["--config", str(write_vl_config(tmp_path, tiny_vl_dir, max_steps=2))]) == 0
    assert len(json.loads((tmp_path / "out" / "loss_history.json").read_text())) == 2
