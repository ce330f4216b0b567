"""Image rows through the SFT pipeline: the images column, their tokens, and truncation that never cuts an image."""

from __future__ import annotations

import pytest

from qlora_train.config import DataConfig
from qlora_train.data import process_rows
from qlora_train.masking import IGNORE_INDEX

WORDS = " ".join(f"word{i}" for i in range(40))


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """Three PNGs: 56x56 (4 image tokens), 112x56 (8), 224x224 (64)."""
    from PIL import Image

    d = tmp_path_factory.mktemp("pictures")
    paths = {}
    for name, size in {"small": (56, 56), "wide": (112, 56), "big": (224, 224)}.items():
        paths[name] = str(d / f"{name}.png")
        Image.new("RGB", size, (200, 30, 30)).save(paths[name])
    return paths


def user(text: str, *images: str) -> dict:
    return {"role": "user", "content": [*({"type": "image", "image": p} for p in images),
                                        {"type": "text", "text": text}]}


def row(*turns) -> dict:
    msgs = []
    for u, a in turns:
        msgs += [u, {"role": "assistant", "content": a}]
    return {"messages": msgs}


def test_images_column_and_counts(vl_tok, pictures):
    out = process_rows([row((user("two?", pictures["small"], pictures["wide"]), "yes")), row((user("none"), "ok"))],
                       vl_tok, DataConfig(max_length=256))
    assert out["drop_reason"] == ["", ""]
    assert out["images"] == [[pictures["small"], pictures["wide"]], []]
    assert out["num_images"] == [2, 0] and out["num_image_tokens"] == [12, 0]
    pad = vl_tok.convert_tokens_to_ids("<|image_pad|>")
    assert out["input_ids"][0].count(pad) == 12
    trained = [t for t in out["labels"][0] if t != IGNORE_INDEX]
    assert vl_tok.decode(trained) == "yes<|im_end|>"


def test_truncation_drops_old_exchanges_with_their_images(vl_tok, pictures):
    r = row((user(f"old {WORDS}", pictures["big"]), f"old answer {WORDS}"),
            (user("new", pictures["small"]), "new answer"))
    full = process_rows([r], vl_tok, DataConfig(max_length=4096))
    assert full["num_images"] == [2] and full["num_image_tokens"] == [68]
    out = process_rows([r], vl_tok, DataConfig(max_length=full["num_tokens"][0] - 10))
    assert out["drop_reason"] == [""] and out["dropped_turns"] == [1]
    assert out["images"] == [[pictures["small"]]] and out["num_image_tokens"] == [4]
    assert out["token_fallback"] == [""]  # whole turns dropped, no token cut


def test_an_image_is_never_cut(vl_tok, pictures):
    r = row((user(f"only {WORDS}", pictures["big"]), f"answer {WORDS}"))
    n = process_rows([r], vl_tok, DataConfig(max_length=4096))["num_tokens"][0]
    for side in ("left", "right"):
        out = process_rows([r], vl_tok, DataConfig(max_length=n - 5, truncate_side=side))
        assert out["drop_reason"] == ["too_long"] and "images are never cut" in out["drop_detail"][0]
    text_only = {"messages": [{"role": "user", "content": f"only {WORDS}"}, {"role": "assistant",
                                                                            "content": f"answer {WORDS}"}]}
    out = process_rows([text_only], vl_tok, DataConfig(max_length=n - 80))
    assert out["drop_reason"] == [""] and out["token_fallback"] == ["left"]  # a text row still takes the cut


# a Qwen3-VL-like layout (written for this test): the reasoning of the turns after the last user turn only, and
# image parts as Qwen2.5-VL writes them
THINKING_VL = """{%- macro c(x) -%}{%- if x is string -%}{{ x }}{%- else -%}{%- for p in x -%}
{%- if p.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>{%- else -%}{{ p.text }}{%- endif -%}
{%- endfor -%}{%- endif -%}{%- endmacro -%}
{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}
{%- endif -%}{%- endfor -%}
{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\n' }}
{%- if m.role == 'assistant' and loop.index0 > ns.last and m.reasoning_content -%}
{{ '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{%- endif -%}
{{ c(m.content) + '<|im_end|>\n' }}{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"""


def test_extra_examples_of_image_rows(vl_tok, pictures, tmp_path):
    """reasoning_history: expand: an extra example holding an image is left out and counted; one before any image
    is kept, and after the rows are exploded it carries no images (the row's are its primary example's)."""
    import copy

    import datasets

    from qlora_train.chat_templates import get_chat_template
    from qlora_train.data.dataset import explode_examples

    (tmp_path / "t.jinja").write_text(THINKING_VL)
    tok = get_chat_template(copy.deepcopy(vl_tok), str(tmp_path / "t.jinja"))

    def answer(text):
        return {"role": "assistant", "content": text, "reasoning_content": f"thinking about {text}"}

    later = {"messages": [{"role": "user", "content": "first?"}, answer("one"),
                          user("second?", pictures["small"]), answer("two")]}
    first = {"messages": [user("first?", pictures["small"]), answer("one"), {"role": "user", "content": "again?"},
                          answer("two")]}
    out = process_rows([later, first], tok, DataConfig(max_length=512, reasoning_history="expand"))
    assert out["drop_reason"] == ["", ""], out["drop_detail"]
    assert [len(x) for x in out["expanded_input_ids"]] == [1, 0]  # the prefix through "one" holds no image
    assert '"reasoning_dropped_turns": 1' in out["parse_report"][1]  # its extra example held the image: counted
    kept = datasets.Dataset.from_dict(dict(out)).select([0])
    exploded, n = explode_examples(kept)
    assert n == 1 and exploded["images"] == [[pictures["small"]], []]
