"""Preference pairs with images (DPO, ORPO): the images are the prompt's, so both sides hold the same image tokens in
the prompt they share, none of them trained; each side's ids are its processor's own; each side trains exactly what
the same pair without images trains. RLAIF-V's rows (``image``, ``question``, ``chosen``, ``rejected``) read as
downloaded: the image (a Hugging Face ``Image`` value, its bytes inline) opens the question."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image

from qlora_train.config import DataConfig, DatasetSource
from qlora_train.data.pairs import build_preference_example, canonicalize_pair, fit_pair
from qlora_train.masking import IGNORE_INDEX, IMAGE_SLOT, SIDES, image_rule
from tests.masking.test_images import image, processor_ids

PAD = "<|image_pad|>"
WORDS = st.sampled_from(["red", "blue", "a", "circle", "square", "it", "is", "two", "yes", "no", "."])


@st.composite
def image_pairs(draw):
    """A prompt of 1-2 exchanges whose user turns hold 0-2 images each (0-4 in all, random sizes, at random places
    among the words), then two different one-turn answers."""
    prompt, left = [], 4
    if draw(st.booleans()):
        prompt.append({"role": "system", "content": "You see images."})
    exchanges = draw(st.integers(1, 2))
    for k in range(exchanges):
        n = draw(st.integers(0, min(2, left)))
        left -= n
        pieces = draw(st.lists(WORDS, min_size=1, max_size=5))
        for _ in range(n):
            pieces.insert(draw(st.integers(0, len(pieces))), IMAGE_SLOT)
        user = {"role": "user", "content": " ".join(pieces)}
        if n:
            user["images"] = [image(draw(st.integers(8, 700)), draw(st.integers(8, 700)), f"/img/{k}-{j}.png")
                              for j in range(n)]
        prompt.append(user)
        if k < exchanges - 1:
            prompt.append({"role": "assistant", "content": " ".join(draw(st.lists(WORDS, min_size=1, max_size=4)))})
    chosen = " ".join(draw(st.lists(WORDS, min_size=1, max_size=5)))
    rejected = draw(st.lists(WORDS, min_size=1, max_size=5).map(" ".join).filter(lambda r: r != chosen))
    return prompt, [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]


def without_images(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "images"} | {"content": m["content"].replace(IMAGE_SLOT, "")}
            for m in messages]


def trained(labels: list[int]) -> list[int]:
    return [t for t in labels if t != IGNORE_INDEX]


@settings(max_examples=60, deadline=None)
@given(image_pairs())
@example(([{"role": "user", "content": f"{IMAGE_SLOT}?", "images": [image(8, 700)]}],  # an edge of the sizes
          [{"role": "assistant", "content": "thin"}], [{"role": "assistant", "content": "wide"}]))
def test_pairs_with_images_share_the_prompts_image_tokens_and_match_the_processor(family_vision, pair):
    tok, proc = family_vision
    prompt, chosen, rejected = pair
    ex = build_preference_example(prompt, chosen, rejected, tok)
    images = [im for m in prompt for im in m.get("images", ())]
    pad = tok.convert_tokens_to_ids(PAD)
    markup = {pad, *tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])}
    text_only = build_preference_example(without_images(prompt), chosen, rejected, tok)
    n = ex["prompt_length"]
    for side in SIDES:
        ids, labels = ex[f"{side}_input_ids"], ex[f"{side}_labels"]
        text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert ids == processor_ids(proc, text, [(im["width"], im["height"]) for im in images])
        assert not markup & set(trained(labels))  # no image or vision-marker token trained on either side
        assert pad not in ids[n:]  # every image token in the shared prompt
        assert trained(labels) == trained(text_only[f"{side}_labels"])  # the same training as without images
    assert ex["chosen_input_ids"][:n] == ex["rejected_input_ids"][:n]  # the prompt's image tokens identical
    rule = image_rule(tok)
    assert ex["chosen_input_ids"].count(pad) == ex["rejected_input_ids"].count(pad) == \
        sum(rule.tokens(im["width"], im["height"]) for im in images)
    assert ex["images"] == [im["ref"] for im in images]
    assert ex.get("num_image_tokens", 0) == ex["chosen_input_ids"].count(pad)


def png_bytes(size, colour) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


RLAIF_V_EXTRA = {"ds_name": "shapes", "origin_dataset": "drawn", "origin_split": "train", "image_path": "x.png"}


def rlaif_v_row(idx: int, size=(56, 84), question="What colour is it?", chosen="Red.", rejected="Blue.") -> dict:
    """A row of openbmb/RLAIF-V-Dataset as its parquet holds it: ``image`` a Hugging Face Image value (``bytes``,
    ``path``), the question with no placeholder, chosen and rejected strings, and its bookkeeping columns."""
    return {"image": {"bytes": png_bytes(size, (200, 20, 20)), "path": f"{idx}.png"}, "question": question,
            "chosen": chosen, "rejected": rejected, "idx": idx, **RLAIF_V_EXTRA}


def test_rlaif_v_row_as_downloaded_the_image_opens_the_prompt(vl_tok):
    pair = canonicalize_pair(rlaif_v_row(0), DataConfig(), tokenizer=vl_tok)
    (user,) = pair.prompt
    assert user["content"] == f"{IMAGE_SLOT}What colour is it?"
    assert user["images"][0]["ref"].startswith("data:image/png;base64,") and user["images"][0]["width"] == 56
    assert pair.report.image_rows == 1
    ex = fit_pair(pair, vl_tok, max_length=256).example
    opened = vl_tok.decode(ex["chosen_input_ids"][:ex["prompt_length"]])
    assert f"<|im_start|>user\n<|vision_start|>{PAD * 6}<|vision_end|>What colour is it?<|im_end|>" in opened
    assert vl_tok.decode(trained(ex["chosen_labels"])) == "Red.<|im_end|>"
    assert vl_tok.decode(trained(ex["rejected_labels"])) == "Blue.<|im_end|>"


def test_trl_conversational_layout_reads_the_same_pair(vl_tok, tmp_path):
    """TRL's conversational form of RLAIF-V (``images``, a prompt of content parts, chosen and rejected message
    lists) and a ``<image>`` placeholder give the ids the RLAIF-V row gives."""
    Image.new("RGB", (56, 84), (200, 20, 20)).save(tmp_path / "a.png")
    cfg = DataConfig(image_dir=str(tmp_path))
    rows = [{"image": "a.png", "question": "What colour is it?", "chosen": "Red.", "rejected": "Blue."},
            {"images": ["a.png"], "prompt": "<image>What colour is it?", "chosen": "Red.", "rejected": "Blue."},
            {"images": ["a.png"],
             "prompt": [{"role": "user", "content": [{"type": "image"},
                                                     {"type": "text", "text": "What colour is it?"}]}],
             "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "Red."}]}],
             "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}]}]
    examples = [fit_pair(canonicalize_pair(r, cfg, tokenizer=vl_tok), vl_tok, max_length=256).example for r in rows]
    for ex in examples[1:]:
        assert {k: ex[k] for k in ("chosen_input_ids", "rejected_input_ids", "chosen_labels", "rejected_labels")} \
            == {k: examples[0][k] for k in ("chosen_input_ids", "rejected_input_ids", "chosen_labels",
                                            "rejected_labels")}


def test_rlaif_v_parquet_through_the_pipeline(vl_tok, tmp_path):
    """A parquet file laid out as RLAIF-V's (the image a struct of bytes and path): every pair kept, its images
    column the prompt's image, its image tokens counted; a pair with an unreadable image refused by name."""
    from qlora_train.data.dataset import load_and_process_sources

    rows = [rlaif_v_row(i, size=(56 + 28 * i, 84)) for i in range(3)]
    rows[2]["image"] = {"bytes": b"not an image", "path": "2.png"}
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "rlaif-v.parquet")
    cfg = DataConfig(datasets=[DatasetSource(path=str(tmp_path / "rlaif-v.parquet"))], cache_dir=str(tmp_path / "c"),
                     objective="preference")
    _, processed = load_and_process_sources(cfg.datasets, cfg, vl_tok)
    assert processed["drop_reason"] == ["", "", "bad_image"]
    assert [len(refs) for refs in processed["images"]] == [1, 1, 0]
    assert processed["num_image_tokens"][:2] == [vl_tok.qlora_image_rule.tokens(56, 84),
                                                 vl_tok.qlora_image_rule.tokens(84, 84)]
    assert "rlaif-v.parquet" in processed["drop_detail"][2]
    assert json.loads(processed["parse_report"][0])["image_rows"] == 1


# --- unpaired rows (KTO) with images: the prompt's, as a pair's ---------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(image_pairs())
def test_unpaired_rows_with_images_hold_them_in_the_prompt_and_match_the_processor(family_vision, pair):
    """A KTO row's images are its prompt's: its ids the processor's, every image token before ``prompt_length``
    (the KL estimate's mismatched row keeps that prompt), none trained, the training the row's without images."""
    from qlora_train.data.unpaired import build_unpaired_example

    tok, proc = family_vision
    prompt, completion, _ = pair
    ex = build_unpaired_example(prompt, completion, tok)
    images = [im for m in prompt for im in m.get("images", ())]
    pad = tok.convert_tokens_to_ids(PAD)
    ids, labels = ex["input_ids"], ex["labels"]
    text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert ids == processor_ids(proc, text, [(im["width"], im["height"]) for im in images])
    assert pad not in trained(labels) and pad not in ids[ex["prompt_length"]:]
    assert ids.count(pad) == ex.get("num_image_tokens", 0) == sum(image_rule(tok).tokens(im["width"], im["height"])
                                                                    for im in images)
    assert trained(labels) == trained(build_unpaired_example(without_images(prompt), completion, tok)["labels"])
    assert ex["images"] == [im["ref"] for im in images]


def test_unpaired_rlaif_v_row_and_its_collator_batch(vl_tok, tmp_path):
    """An RLAIF-V-style unpaired row (``image``, ``question``, ``completion``, ``label``): the image opens the
    prompt; ``UnpairedCollator`` gives the row and its mismatched KL row (its prompt, the other row's completion)
    the prompt's pixels, the second half's the first's again, and ``rows_of`` splits them with the rows."""
    import torch

    from qlora_train.data.unpaired import canonicalize_unpaired, fit_unpaired
    from qlora_train.train.collator import UnpairedCollator
    from qlora_train.train.preference import rows_of

    Image.new("RGB", (56, 84), (200, 20, 20)).save(tmp_path / "a.png")
    Image.new("RGB", (120, 60), (20, 20, 200)).save(tmp_path / "b.png")
    cfg = DataConfig(image_dir=str(tmp_path))
    rows = [{"image": "a.png", "question": "What colour is it?", "completion": "Red.", "label": True},
            {"image": "b.png", "question": "And this one?", "completion": "Green.", "label": False}]
    examples = [fit_unpaired(canonicalize_unpaired(r, cfg, tokenizer=vl_tok), vl_tok, max_length=256).example
                for r in rows]
    opened = vl_tok.decode(examples[0]["input_ids"][:examples[0]["prompt_length"]])
    assert f"<|im_start|>user\n<|vision_start|>{PAD * 6}<|vision_end|>What colour is it?<|im_end|>" in opened
    assert vl_tok.decode(trained(examples[1]["labels"])) == "Green.<|im_end|>"
    features = [{**ex, "desirable": int(r["label"])} for ex, r in zip(examples, rows)]
    batch = UnpairedCollator(vl_tok.pad_token_id, rule=image_rule(vl_tok))(features)
    pad = vl_tok.convert_tokens_to_ids(PAD)
    held = (batch["input_ids"] == pad).sum(dim=1).tolist()
    assert held == [6, 8, 6, 8]  # 56x84 -> 2x3 tokens, 120x60 -> 4x2; the KL rows keep their prompts' images
    assert vl_tok.decode(trained(batch["labels"][2].tolist())) == "Green.<|im_end|>"  # row 0's prompt, row 1's answer
    first, second = rows_of(batch, slice(None, 2)), rows_of(batch, slice(2, None))
    assert torch.equal(first["pixel_values"], second["pixel_values"])
    assert first["image_grid_thw"].tolist() == second["image_grid_thw"].tolist() == [[1, 6, 4], [1, 4, 8]]
    assert torch.equal(first["mm_token_type_ids"], (batch["input_ids"][:2] == pad).int())


# --- VLFeedback's rated completions, read as downloaded --------------------------------------------------------

def test_vlfeedback_sample_pairs_the_highest_against_the_lowest_rated(vl_tok):
    """The bundled VLFeedback-layout sample (configs/data/vlfeedback-sample.jsonl: prompt, image, models,
    completions with ratings by aspect): the mean-rated highest completion is chosen, the lowest rejected, the image
    the prompt's; a row whose rated completions tie, and one with a single rated completion, are refused as
    ``pair_no_preference``, each with its reason."""
    from pathlib import Path

    from qlora_train.masking import RowRejected

    sample = Path(__file__).resolve().parents[2] / "configs" / "data" / "vlfeedback-sample.jsonl"
    cfg = DataConfig(image_dir=str(sample.parent))
    rows = [json.loads(line) for line in sample.read_text().splitlines()]
    kept, refused = [], []
    for row in rows:
        try:
            kept.append(canonicalize_pair(row, cfg, tokenizer=vl_tok))
        except RowRejected as rej:
            refused.append((row["id"], rej.reason, rej.detail))
    assert [(p.chosen[0]["content"], p.rejected[0]["content"], p.score_chosen, p.score_rejected) for p in kept] == [
        ("It is red.", "It is yellow.", 5.0, 8 / 3), ("A circle.", "A square.", 5.0, 7 / 3)]
    assert [p.prompt[0]["content"] for p in kept] == [f"{IMAGE_SLOT}What colour is this shape?",
                                                      f"{IMAGE_SLOT}What shape is in this picture?"]
    assert [(i, r) for i, r, _ in refused] == [("shapes-2", "pair_no_preference"), ("shapes-3", "pair_no_preference")]
    assert "all 2 rated completions score 4" in refused[0][2] and "1 of 2 completions rated" in refused[1][2]
    ex = fit_pair(kept[0], vl_tok, max_length=512).example
    n = ex["prompt_length"]
    assert ex["chosen_input_ids"][:n] == ex["rejected_input_ids"][:n]  # the prompt's image tokens on both sides
    pad = vl_tok.convert_tokens_to_ids(PAD)
    assert pad in ex["chosen_input_ids"][:n] and pad not in trained(ex["chosen_labels"])
