"""Write configs/data/quickstart-vl.jsonl and its images (configs/data/images/*.png): a small, deterministic
vision-language dataset we drew ourselves with Pillow, for `make demo-vl`; and configs/data/quickstart-vl-dpo.jsonl,
preference pairs about the same images in RLAIF-V's layout (``image``, ``question``, ``chosen``, ``rejected`` and its
bookkeeping columns), for `make demo-vl-dpo`; and configs/data/quickstart-vl-kto.jsonl, the same pairs as unpaired
rows (``image``, ``question``, ``completion``, ``label``: the chosen answer desirable, the rejected one not), for
`make demo-vl-kto`.

Each image is one coloured shape (red, green, blue or yellow; square, circle or triangle) on white, at one of
several sizes and aspect ratios. Rows are OpenAI content parts with image paths relative to the data file:
one image (its colour, its shape, or both), two images (their colours in order), or none (a text question about
colours), so that a tiny model can learn the short answers and its loss falls.

    python scripts/make_vl_sample_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("square", "circle", "triangle")
SIZES = ((56, 56), (84, 56), (56, 112), (112, 84), (140, 56), (98, 98))  # width x height: 4 to 20 image tokens
DATA = Path(__file__).resolve().parent.parent / "configs" / "data"


def draw(colour: str, shape: str, size: tuple[int, int]) -> Image.Image:
    """One shape in ``colour``, centred on white, filling most of the smaller side."""
    w, h = size
    im = Image.new("RGB", size, (255, 255, 255))
    d = ImageDraw.Draw(im)
    r = min(w, h) * 0.4
    box = (w / 2 - r, h / 2 - r, w / 2 + r, h / 2 + r)
    fill = COLOURS[colour]
    if shape == "square":
        d.rectangle(box, fill=fill)
    elif shape == "circle":
        d.ellipse(box, fill=fill)
    else:
        d.polygon([(w / 2, h / 2 - r), (w / 2 + r, h / 2 + r), (w / 2 - r, h / 2 + r)], fill=fill)
    return im


def image_part(name: str) -> dict:
    return {"type": "image", "image": f"images/{name}.png"}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def main() -> None:
    rng = random.Random(0)
    (DATA / "images").mkdir(parents=True, exist_ok=True)
    names = []
    for k, (colour, shape) in enumerate((c, s) for c in COLOURS for s in SHAPES):
        name = f"{colour}_{shape}"
        draw(colour, shape, SIZES[k % len(SIZES)]).save(DATA / "images" / f"{name}.png", optimize=True)
        names.append(name)
    rows = []
    for i in range(48):
        kind = i % 4
        if kind == 0:  # the colour of one shape
            name = rng.choice(names)
            rows.append([{"role": "user", "content": [image_part(name), text_part("What colour is this shape?")]},
                         {"role": "assistant", "content": f"It is {name.split('_')[0]}."}])
        elif kind == 1:  # the shape, the question before the image
            name = rng.choice(names)
            rows.append([{"role": "system", "content": "Answer in a few words."},
                         {"role": "user", "content": [text_part("What shape is in this picture?"), image_part(name)]},
                         {"role": "assistant", "content": f"A {name.split('_')[1]}."}])
        elif kind == 2:  # two images, then a second turn about the first one
            a, b = rng.sample(names, 2)
            rows.append([{"role": "user", "content": [image_part(a), image_part(b),
                                                      text_part("Which colours are these two shapes?")]},
                         {"role": "assistant", "content": f"{a.split('_')[0].capitalize()}, then "
                                                          f"{b.split('_')[0]}."},
                         {"role": "user", "content": "And the shape of the first?"},
                         {"role": "assistant", "content": f"A {a.split('_')[1]}."}])
        else:  # no image
            colour = rng.choice(sorted(COLOURS))
            rows.append([{"role": "user", "content": f"Name a shape that could be {colour}."},
                         {"role": "assistant", "content": f"A {rng.choice(SHAPES)}."}])
    with open(DATA / "quickstart-vl.jsonl", "w", encoding="utf-8") as f:
        for messages in rows:
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {len(rows)} rows and {len(names)} images to {DATA}")
    pairs = preference_pairs(names, random.Random(1))
    with open(DATA / "quickstart-vl-dpo.jsonl", "w", encoding="utf-8") as f:
        for row in pairs:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(pairs)} preference pairs to {DATA / 'quickstart-vl-dpo.jsonl'}")
    unpaired = [{"image": row["image"], "question": row["question"], "completion": row[side],
                 "label": side == "chosen"} for row in pairs for side in ("chosen", "rejected")]
    with open(DATA / "quickstart-vl-kto.jsonl", "w", encoding="utf-8") as f:
        for row in unpaired:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(unpaired)} unpaired rows to {DATA / 'quickstart-vl-kto.jsonl'}")


def preference_pairs(names: list[str], rng: random.Random, n: int = 32) -> list[dict]:
    """RLAIF-V-layout rows: one image, a question about it without a placeholder (the image opens the prompt), the
    right answer chosen; rejected, a wrong colour or shape (every other row), or an answer that ignores the image
    (the rest: what a tiny random model can learn to disprefer without seeing, so that the demo's loss falls)."""
    rows = []
    for i in range(n):
        name = rng.choice(names)
        colour, shape = name.split("_")
        if i % 2 == 0:
            wrong = rng.choice([c for c in COLOURS if c != colour])
            question, chosen, rejected = "What colour is this shape?", f"It is {colour}.", f"It is {wrong}."
        else:
            wrong = rng.choice([s for s in SHAPES if s != shape])
            question, chosen, rejected = "What shape is in this picture?", f"A {shape}.", f"A {wrong}."
        if i % 4 >= 2:
            rejected = "I cannot see any image."
        rows.append({"ds_name": "shapes", "image": f"images/{name}.png", "question": question, "chosen": chosen,
                     "rejected": rejected, "origin_dataset": "qlora-train drawn shapes", "origin_split": "train",
                     "idx": i, "image_path": f"images/{name}.png"})
    return rows


if __name__ == "__main__":
    main()
