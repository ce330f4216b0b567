"""A vision-language run exported: ``--merge`` writes a model that serves (its image processor, tokenizer and
template beside it), ``--generate --image`` answers about an image (the tiny random model: any text)."""

from __future__ import annotations

import pytest
import torch

from qlora_train.cli import main
from qlora_train.export.adapter import ExportError
from tests.vision_rows import IMAGE_TOKEN_ID, feed_rows, processed_rows, write_images, write_vl_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory, tiny_vl_dir):
    """(config path, drawn images) of a finished run of the tiny Qwen2.5-VL on image rows made by hand."""
    from qlora_train.config import ModelConfig, load_config
    from qlora_train.tokenizer import load_tokenizer
    from qlora_train.train.run import train

    tmp = tmp_path_factory.mktemp("vl-run")
    images = write_images(tmp / "images")
    rows = processed_rows(load_tokenizer(ModelConfig(name_or_path=str(tiny_vl_dir))), images)
    path = write_vl_config(tmp, tiny_vl_dir, max_steps=2)
    with pytest.MonkeyPatch.context() as mp:
        feed_rows(mp, rows)
        train(load_config(path))
    return str(path), images


def test_merge_writes_a_model_that_serves(vl_run, tiny_vl_dir, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    path, _ = vl_run
    merged = tmp_path / "merged"
    assert main(["--config", path, "--merge", "--merge-dir", str(merged)]) == 0
    processor = AutoImageProcessor.from_pretrained(merged)
    assert processor.to_dict()["size"] == {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}
    tok = AutoTokenizer.from_pretrained(merged)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in tok.chat_template
    model = AutoModelForImageTextToText.from_pretrained(merged)
    base = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir)
    weights, base_weights = model.state_dict(), base.state_dict()
    tower = [k for k in base_weights if k.startswith("model.visual.")]
    assert tower and all(torch.equal(weights[k], base_weights[k]) for k in tower)  # frozen: as the base's
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[q], base_weights[q])  # the adapter merged in


def test_generate_answers_about_an_image(vl_run, capsys):
    from qlora_train.config import load_config
    from qlora_train.export.generate import answer, load_chat_model, prompt_inputs, user_message

    path, images = vl_run
    red = images["red"]["ref"]
    assert main(["--config", path, "--generate", "What colour is this?", "--image", red,
                 "--max-new-tokens", "3"]) == 0
    assert isinstance(capsys.readouterr().out, str)
    chat = load_chat_model(load_config(path))
    message = user_message("What colour is this?", [red, images["blue"]["ref"]])
    inputs = prompt_inputs(chat.tokenizer, [message])
    assert (inputs["input_ids"] == IMAGE_TOKEN_ID).sum().item() == 4 + 12  # as training expands them
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]]
    assert torch.equal(inputs["mm_token_type_ids"], (inputs["input_ids"] == IMAGE_TOKEN_ID).int())
    reply = answer(chat, [message], max_new_tokens=3)
    assert isinstance(reply.text, str) and 1 <= len(reply.token_ids) <= 3


def test_generate_with_the_merged_model_and_an_image(vl_run, tmp_path, capsys):
    path, images = vl_run
    merged = str(tmp_path / "merged")
    assert main(["--config", path, "--merge", "--merge-dir", merged]) == 0
    assert main(["--config", path, "--generate", "Colour?", "--image", images["green"]["ref"], "--merged",
                 "--merge-dir", merged, "--max-new-tokens", "2"]) == 0


def test_image_needs_generate_and_a_readable_file(vl_run, tmp_path):
    from qlora_train.export.generate import user_message

    path, _ = vl_run
    with pytest.raises(SystemExit) as exc:
        main(["--config", path, "--image", "x.png"])
    assert exc.value.code == 2
    with pytest.raises(ExportError, match=r"--image .*missing\.png: cannot read it"):
        user_message("Colour?", [str(tmp_path / "missing.png")])


def test_image_for_a_text_model_is_refused(tiny_vl_dir, vl_run):
    from transformers import AutoTokenizer

    from qlora_train.export.generate import prompt_inputs, user_message

    _, images = vl_run
    text_only = AutoTokenizer.from_pretrained(tiny_vl_dir)  # loaded without the loader: no image rule on it
    with pytest.raises(ExportError, match="not a vision-language model"):
        prompt_inputs(text_only, [user_message("Colour?", [images["red"]["ref"]])])
