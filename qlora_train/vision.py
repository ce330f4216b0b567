"""Vision-language bases: whether ``model.name_or_path`` reads images, its image processor, and the rule that the
processor's expansion of an image follows (``masking.ImageRule``), set on the tokenizer where it is loaded.

A base is vision-language when its config has a ``vision_config``. ``FAMILIES`` is the one place that names the
families whose images this trainer reads (each with its ``model_type``, vision tower, image token and shipped chat
template; ``python -m qlora_train.tiny --vision FAMILY`` builds a tiny one of each), and how its processor writes an
image (its ``ImageRule``): the Qwen2-VL-style models (one ``<|image_pad|>`` per merged patch, ``image_grid_thw``
beside the pixels), Gemma 3 (a fixed count of ``<image_soft_token>`` between its image markers,
``token_type_ids``), Mistral 3 and Idefics3 (structured expansions, ``masking.image_layouts``: a run of ``[IMG]`` a
row of the resized image between ``[IMG_BREAK]`` / ``[IMG_END]``, ``image_sizes`` beside the pixels; a run of
``<image>`` a tile after its ``<row_R_col_C>``, then the global image's), InternVL 3 (one run of ``<IMG_CONTEXT>``
between ``<img>`` and ``</img>``, a fixed count a tile of the grid the image's size picks), LLaVA-OneVision
(``<image>`` repeated by the image's size and its row's image count, anyres: ``AnyresCount``). Another
vision-language base (PaliGemma, Qwen3.5, ...) trains on text rows as before; a config that asks it for
images (``data.image_dir``, ``data.image_root``, ``lora.train_vision``) is refused before any data loads, and a row
with images for it is refused (``bad_image``), which training then turns into one ``ConfigError`` naming the model
type (``check_images_readable``). Both name the supported families.

    >>> vision_base(ModelConfig(name_or_path=".cache/tiny-qwen2.5-vl"))
    VisionBase(model_type='qwen2_5_vl', tower='model.visual')

Imports neither torch nor the model code: the tokenizer-only runs (``--stats-only``) load the image processor too.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from qlora_train.config import Config, ModelConfig
from qlora_train.errors import ConfigError, ModelLoadError

log = logging.getLogger(__name__)

IMAGE_TOKEN = "<|image_pad|>"  # what the Qwen-VL templates write for an image and their processors repeat


@dataclass(frozen=True)
class VisionFamily:
    """A vision-language family whose images this trainer reads: its name (``--vision FAMILY``, the docs), the
    ``model_type`` of its ``config.json``, its vision tower's module path, the token its template writes for an image
    and its processor repeats, and the chat template we ship for it (``model.chat_template``)."""

    name: str  # "qwen2.5-vl"
    model_type: str  # "qwen2_5_vl"
    tower: str  # "model.visual"
    chat_template: str  # a shipped template (qlora_train/templates)
    image_token: str = IMAGE_TOKEN  # the token the processor repeats, one per image feature
    examples: str = ""
    # how the processor writes an image (``masking.ImageRule``): the template's placeholder ("": the image token),
    # the text around the image's tokens, and the config key of a fixed count of them (None: by the image's size,
    # the Qwen-VL grids)
    placeholder: str = ""
    wrapper: tuple[str, str] = ("", "")
    fixed_tokens_key: str | None = None
    type_ids: str = "mm_token_type_ids"  # the model input marking image tokens
    markers: tuple[str, ...] = ()  # tokens only the processor writes (a render holding one is refused)
    packable: bool = True  # whether packed image rows are supported (each example's own 3D positions)
    # a structured expansion (``masking.image_layouts``): several runs of the image token an image between markers
    # the image's size decides ("pixtral": Mistral 3's rows); None: one run an image
    layout: str | None = None
    unpackable_why: str = ("its image tokens attend to each other both ways (token_type_ids), which the packed "
                           "block mask does not carry")


FAMILIES = (
    VisionFamily("qwen2-vl", "qwen2_vl", "model.visual", "qwen2-vl", examples="Qwen2-VL-2B/7B/72B-Instruct"),
    VisionFamily("qwen2.5-vl", "qwen2_5_vl", "model.visual", "qwen2.5-vl",
                 examples="Qwen2.5-VL-3B/7B/32B/72B-Instruct"),
    VisionFamily("qwen3-vl", "qwen3_vl", "model.visual", "qwen3-vl", examples="Qwen3-VL-2B/4B/8B/32B-Instruct"),
    # Gemma 3: the template writes <start_of_image>, Gemma3Processor writes "\n\n<start_of_image>" + 256 (its
    # image_seq_length, the model's mm_tokens_per_image) x <image_soft_token> + "<end_of_image>\n\n" in its place,
    # whatever the image's size (resized to the tower's square; pan-and-scan crops are not used); token_type_ids
    # mark the image tokens (each image's tokens attend to each other both ways)
    VisionFamily("gemma3", "gemma3", "model.vision_tower", "gemma3", image_token="<image_soft_token>",
                 examples="gemma-3-4b/12b/27b-it", placeholder="<start_of_image>",
                 wrapper=("\n\n<start_of_image>", "<end_of_image>\n\n"), fixed_tokens_key="mm_tokens_per_image",
                 type_ids="token_type_ids", markers=("<end_of_image>",), packable=False),
    # Mistral 3 (Pixtral's expansion): the template writes [IMG], PixtralProcessor writes a row of [IMG] per token
    # row of the resized image, [IMG_BREAK] after each row but the last, [IMG_END] last (masking.image_layouts);
    # image_sizes beside the pixels, no type ids
    VisionFamily("mistral3", "mistral3", "model.vision_tower", "mistral3", image_token="[IMG]",
                 examples="Mistral-Small-3.1/3.2-24B-Instruct", type_ids="", markers=("[IMG_BREAK]", "[IMG_END]"),
                 packable=False, layout="pixtral",
                 unpackable_why="packed image rows are not proved for it (no packed-vs-unpacked loss check)"),
    # Idefics3 (SmolVLM writes the same text; its processor needs num2words, not installed here): the template writes
    # <image>, Idefics3Processor writes per tile <fake_token_around_image><row_R_col_C> + image_seq_len x <image>,
    # "\n" after each tile row, then the global image (masking.image_layouts); pixel_attention_mask beside the pixels
    VisionFamily("idefics3", "idefics3", "model.vision_model", "idefics3", image_token="<image>",
                 examples="Idefics3-8B-Llama3", type_ids="", packable=False, layout="idefics3",
                 unpackable_why="packed image rows are not proved for it (no packed-vs-unpacked loss check)"),
    # InternVL 3 (transformers-native, the -hf checkpoints; a Qwen2.5 language model): the template writes
    # <IMG_CONTEXT>, InternVLProcessor writes <img> + image_seq_length x <IMG_CONTEXT> a tile + </img>, the tiles
    # GotOcr2's crop_to_patches grid by the image's size plus a thumbnail (masking.image_layouts); no type ids
    VisionFamily("internvl3", "internvl", "model.vision_tower", "internvl3", image_token="<IMG_CONTEXT>",
                 examples="InternVL3-1B/2B/8B/14B/38B-hf", type_ids="", markers=("<img>", "</img>"),
                 packable=False, layout="internvl",
                 unpackable_why="packed image rows are not proved for it (no packed-vs-unpacked loss check)"),
    # LLaVA-OneVision: the template writes <image>, LlavaOnevisionProcessor writes <image> x N in its place, N by the
    # image's size (anyres: the base crop's features + the unpadded grid's + one newline a grid row; a row of
    # several images: each the base crop's + 1), ``AnyresCount``; the model reads image_sizes and batch_num_images
    VisionFamily("llava-onevision", "llava_onevision", "model.vision_tower", "llava-onevision", image_token="<image>",
                 examples="llava-onevision-qwen2-0.5b/7b/72b-ov-hf", type_ids="", markers=("<video>",),
                 packable=False,
                 unpackable_why="its images' features are laid out by the batch's image_sizes and batch_num_images, "
                                "per batch row; a packed row's no-contamination is not proved"),
)
FAMILY_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}
SUPPORTED = {f.model_type: f.tower for f in FAMILIES}  # model type -> its vision tower's module path


def family_named(name: str) -> VisionFamily:
    """A family by its name or its ``model_type``; ``ValueError`` naming the supported ones."""
    for f in FAMILIES:
        if name in (f.name, f.model_type):
            return f
    raise ValueError(f"unknown vision-language family {name!r}: supported: {supported_families()}")


def supported_families() -> str:
    """The supported families as errors name them: ``qwen2-vl (qwen2_vl), ...``."""
    return ", ".join(f"{f.name} ({f.model_type})" for f in FAMILIES)


@dataclass(frozen=True)
class VisionBase:
    """A vision-language base: its ``model_type`` and its vision tower (``tower``: the module path, e.g.
    ``model.visual``; ``None`` for a model type whose images this trainer does not read)."""

    model_type: str
    tower: str | None

    @property
    def supported(self) -> bool:
        return self.tower is not None

    @property
    def family(self) -> VisionFamily | None:
        return FAMILY_BY_MODEL_TYPE.get(self.model_type)


def model_config_dict(cfg: ModelConfig) -> dict | None:
    """The base's ``config.json`` as a dict: read from a local folder directly (no torch), else through
    ``AutoConfig`` (a hub id); None for a local folder without one (a tokenizer alone). ``ModelLoadError`` when
    it cannot be read."""
    local = Path(cfg.name_or_path) / "config.json"
    if Path(cfg.name_or_path).is_dir() and not local.is_file():
        return None
    if local.is_file():
        try:
            return json.loads(local.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read the model config {local}: {exc}") from None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code).to_dict()
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the model config of {cfg.name_or_path}: {' '.join(str(exc).split())}") \
            from None


def vision_base(cfg: ModelConfig, *, strict: bool = True) -> VisionBase | None:
    """``VisionBase`` of a vision-language base (its config has a ``vision_config``), None for a text-only one and
    for a folder without a model config. Not ``strict`` (a tokenizer-only run, whose tokenizer loaded): a hub
    config that cannot be fetched reads as a text-only base (training, strict, then says why it cannot load)."""
    try:
        config = model_config_dict(cfg)
    except ModelLoadError:
        if strict:
            raise
        log.info("the model config of %s cannot be read: its rows are read as a text-only model's", cfg.name_or_path)
        return None
    if not config or not config.get("vision_config"):
        return None
    model_type = str(config.get("model_type", ""))
    return VisionBase(model_type, SUPPORTED.get(model_type))


def load_image_processor(cfg: ModelConfig, path: str | Path | None = None):
    """The image processor saved with the base (or in ``path``: an adapter or merged folder);
    ``ModelLoadError`` when none loads."""
    from transformers import AutoImageProcessor

    where = path if path is not None else cfg.name_or_path
    try:
        return AutoImageProcessor.from_pretrained(where, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{cfg.name_or_path} is a vision-language model, but no image processor loads from "
                             f"{where}: {' '.join(str(exc).split())}") from None


def image_rule_for(cfg: ModelConfig, tokenizer, base: VisionBase | None = None, *,
                   processor_path: str | Path | None = None):
    """The ``ImageRule`` a tokenizer of this base renders images with (its image processor's), or None for a
    text-only base and for a vision-language one whose images this trainer does not read (logged)."""
    from qlora_train.masking import ImageRule

    base = vision_base(cfg, strict=False) if base is None else base
    if base is None:
        return None
    if not base.supported:
        log.info("%s is a %s vision-language model: this trainer reads images for %s only; it trains on text "
                 "rows, and a row with images is refused (bad_image)", cfg.name_or_path, base.model_type,
                 supported_families())
        return None
    family = base.family
    for token in (family.image_token, family.placeholder or family.image_token):
        if token not in tokenizer.get_added_vocab():
            raise ModelLoadError(f"{cfg.name_or_path} is a {base.model_type} model, but its tokenizer has no "
                                 f"{token} token")
    processor = load_image_processor(cfg, processor_path)
    if family.layout is not None:
        rule = layout_rule(family, processor, tokenizer, model_config_dict(cfg) or {})
        check_saved_processor(rule.layout, Path(processor_path if processor_path is not None else cfg.name_or_path))
        return rule
    if family.model_type == "llava_onevision":
        return ImageRule(family.image_token, tokenizer.convert_tokens_to_ids(family.image_token), processor,
                         tuple(t for t in family.markers if t in tokenizer.get_added_vocab()), type_ids="",
                         counter=anyres_count(cfg, processor, processor_path))
    if family.fixed_tokens_key is not None:
        if getattr(processor, "do_pan_and_scan", False):  # crops add whole image sequences by the image's shape
            raise ModelLoadError(f"the image processor of {cfg.name_or_path} has do_pan_and_scan: true: its crops "
                                 "(each one more image sequence, by the image's shape) are not read; set it to false "
                                 "in preprocessor_config.json")
        return ImageRule.wrapped(processor, tokenizer, placeholder=family.placeholder, image_token=family.image_token,
                                 before=family.wrapper[0], after=family.wrapper[1],
                                 tokens=fixed_image_tokens(cfg, family, processor_path), type_ids=family.type_ids,
                                 other_tokens=family.markers)
    if not hasattr(processor, "merge_size") or not hasattr(processor, "get_number_of_image_patches"):
        raise ConfigError([f"model.name_or_path: the image processor of {cfg.name_or_path} "
                           f"({type(processor).__name__}) is not a Qwen2-VL-style one (merge_size, image_grid_thw); "
                           f"supported: {supported_families()}"])
    return ImageRule.of(processor, tokenizer, family.image_token)


def layout_rule(family: VisionFamily, processor, tokenizer, config: dict):
    """The ``ImageRule`` of a family with a structured expansion (``family.layout``), from its model config and
    image processor: Mistral 3's ``PixtralRows`` (a token ``vision_config.patch_size`` x ``spatial_merge_size``
    pixels a side, as PixtralProcessor with the model's values; images shrunk to the image processor's
    ``size["longest_edge"]``); Idefics3's ``Idefics3Tiles`` (``(image_size // patch_size)² / scale_factor²`` image
    tokens a tile, the image processor's ``size``, ``max_image_size`` and ``do_image_splitting``)."""
    from qlora_train.masking import Idefics3Tiles, ImageRule, InternVLTiles, PixtralRows

    vision = config.get("vision_config") or {}
    if family.layout == "pixtral":
        patch = int(vision.get("patch_size", 16)) * int(config.get("spatial_merge_size", 1))
        layout = PixtralRows(patch, int(processor.size["longest_edge"]), family.image_token, *family.markers)
    elif family.layout == "idefics3":  # image_seq_len as the processor documents it: the tower's patches, shuffled
        seq = int((int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))) ** 2
                  / float(config.get("scale_factor", 2)) ** 2)
        layout = Idefics3Tiles(seq, int(processor.size["longest_edge"]), int(processor.max_image_size["longest_edge"]),
                               bool(processor.do_image_splitting), family.image_token)
    elif family.layout == "internvl":  # image_seq_length as the processor documents it: the tower's patches, shuffled
        tile = (int(processor.size["height"]), int(processor.size["width"]))
        layout = InternVLTiles(internvl_seq_length(config), tile, int(processor.min_patches),
                               int(processor.max_patches), family.image_token, *family.markers)
    else:
        raise ValueError(f"no image layout {family.layout!r}")
    added = tokenizer.get_added_vocab()
    for token in layout.markers:
        if token not in added:
            raise ModelLoadError(f"the {family.model_type} tokenizer has no {token} token")
    unread = tuple(t for t in getattr(layout, "unread", ()) if t in added)  # InternVL's <video>: no video is read
    return ImageRule(family.image_token, tokenizer.convert_tokens_to_ids(family.image_token), processor,
                     layout.markers + unread, type_ids=family.type_ids, layout=layout)


def internvl_seq_length(config: dict) -> int:
    """InternVL's image tokens a tile: ``(image_size // patch_size)² x downsample_ratio²`` of its model config
    (the real InternVL3's 448 // 14 = 32, 1024 / 4 = 256)."""
    vision = config.get("vision_config") or {}

    def side(key: str, default: int) -> int:
        v = vision.get(key, default)
        return int(v[0] if isinstance(v, (list, tuple)) else v)

    return int((side("image_size", 448) // side("patch_size", 14)) ** 2 * float(config.get("downsample_ratio", 0.5))
               ** 2)


def check_saved_processor(layout, folder: Path) -> None:
    """A saved ``processor_config.json`` (where there is one) must make the expansion the rule makes from the model
    config: PixtralProcessor's ``patch_size`` x ``spatial_merge_size`` the rule's token side, Idefics3Processor's
    ``image_seq_len`` its tokens a tile; ``ModelLoadError`` otherwise (the processor would write other image tokens
    than the model reads)."""
    saved = folder / "processor_config.json"
    if not saved.is_file():
        return
    try:
        own = json.loads(saved.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {saved}: {exc}") from None
    if hasattr(layout, "patch"):  # PixtralRows
        made, what = int(own.get("patch_size", 16)) * int(own.get("spatial_merge_size", 1)), "patch_size x " \
            "spatial_merge_size"
        ours = layout.patch
    elif hasattr(layout, "image_seq_length"):  # InternVLTiles
        made, what, ours = int(own.get("image_seq_length", 256)), "image_seq_length", layout.image_seq_length
    else:  # Idefics3Tiles
        made, what, ours = int(own.get("image_seq_len", 169)), "image_seq_len", layout.image_seq_len
    if made != ours:
        raise ModelLoadError(f"{saved}: {what} {made} differs from the model config's {ours}: the processor would "
                             "write another count of image tokens than the model reads")


def fixed_image_tokens(cfg: ModelConfig, family: VisionFamily, processor_path: str | Path | None = None) -> int:
    """A fixed-count family's image tokens an image (Gemma 3: the model config's ``mm_tokens_per_image``), which
    the processor's own ``image_seq_length`` (``processor_config.json``, where saved) must equal:
    ``ModelLoadError`` otherwise."""
    config = model_config_dict(cfg) or {}
    n = config.get(family.fixed_tokens_key)
    if not isinstance(n, int) or n <= 0:
        raise ModelLoadError(f"{cfg.name_or_path} is a {family.model_type} model, but its config has no "
                             f"{family.fixed_tokens_key} (image tokens an image)")
    saved = Path(processor_path if processor_path is not None else cfg.name_or_path) / "processor_config.json"
    if saved.is_file():
        try:
            own = json.loads(saved.read_text(encoding="utf-8")).get("image_seq_length", n)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {saved}: {exc}") from None
        if own != n:
            raise ModelLoadError(f"{saved}: image_seq_length {own} differs from the model config's "
                                 f"{family.fixed_tokens_key} {n}: the processor would write another count of image "
                                 "tokens than the model reads")
    return n


@dataclass(frozen=True)
class AnyresCount:
    """LLaVA-OneVision's count of ``<image>`` tokens an image (``LlavaOnevisionProcessor``'s, from the image's size
    alone): alone in its row, the base crop's ``num_image_tokens`` + the features of the best grid
    (``image_grid_pinpoints``) unpadded to the image's aspect + one newline a feature row (scaled down past
    ``anyres_max_N`` crops); in a row of several images, ``num_image_tokens`` + 1 each; one fewer with the
    ``default`` feature select strategy (its CLS dropped)."""

    pinpoints: tuple[tuple[int, int], ...]
    crop: int  # the side of a crop (the image processor's size)
    num_image_tokens: int  # the base crop's features (patches a side, squared)
    max_crops: int  # vision_aspect_ratio "anyres_max_9" -> 9
    default_select: bool  # vision_feature_select_strategy == "default"

    def __call__(self, width: int, height: int, images: int = 1) -> int:
        if images != 1:
            return self.num_image_tokens + 1 - self.default_select
        from transformers.image_processing_utils import select_best_resolution

        best_h, best_w = select_best_resolution([height, width], [list(p) for p in self.pinpoints])
        side = int(math.sqrt(self.num_image_tokens))
        rows, cols = side * (best_h // self.crop), side * (best_w // self.crop)
        if width / height > cols / rows:
            rows -= (rows - int(round(height * (cols / width), 7))) // 2 * 2
        else:
            cols -= (cols - int(round(width * (rows / height), 7))) // 2 * 2
        features, newlines = rows * cols, rows
        ratio = math.sqrt(rows * cols / (self.max_crops * side ** 2))
        if ratio > 1.1:
            features, newlines = int(rows // ratio) * int(cols // ratio), int(rows // ratio)
        return self.num_image_tokens + features + newlines - self.default_select


@dataclass(frozen=True)
class TileCount:
    """InternVL 3's count of ``<IMG_CONTEXT>`` tokens an image (``InternVLProcessor``'s, from the image's size alone):
    ``tile_tokens`` (its ``image_seq_length``) a tile, the tiles as GotOcr2's ``crop_to_patches`` makes them (the
    image processor's ``get_number_of_image_patches``: the grid of ``min_patches``..``max_patches`` tiles closest to
    the image's aspect, plus a thumbnail tile when the grid has more than one)."""

    image_processor: object  # GotOcr2ImageProcessor(Pil) with crop_to_patches on
    tile_tokens: int

    def __call__(self, width: int, height: int, images: int = 1) -> int:
        return self.tile_tokens * int(self.image_processor.get_number_of_image_patches(height, width, {}))


def internvl_tile_tokens(cfg: ModelConfig) -> int:
    """An InternVL base's image tokens a tile: its config's ``image_seq_length`` (the tower's patches a side,
    squared, times ``downsample_ratio``²); ``ModelLoadError`` when it is missing."""
    n = (model_config_dict(cfg) or {}).get("image_seq_length")
    if not isinstance(n, int) or n <= 0:
        raise ModelLoadError(f"{cfg.name_or_path} is an internvl model, but its config has no image_seq_length "
                             "(image tokens a tile)")
    return n


def anyres_count(cfg: ModelConfig, processor, processor_path: str | Path | None = None) -> AnyresCount:
    """The ``AnyresCount`` of a LLaVA-OneVision base: its ``processor_config.json`` (num_image_tokens, the feature
    select strategy, vision_aspect_ratio; in ``processor_path``, else the base's folder) and its image processor
    (grid pinpoints, crop size); ``ModelLoadError`` when the processor config is missing or lacks num_image_tokens."""
    saved = Path(processor_path if processor_path is not None else cfg.name_or_path) / "processor_config.json"
    if not saved.is_file():  # an adapter or merged folder saves the image processor alone: the base's then
        saved = Path(cfg.name_or_path) / "processor_config.json"
    try:
        own = json.loads(saved.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{cfg.name_or_path} is a llava_onevision model: cannot read {saved} (its image tokens "
                             f"an image): {exc}") from None
    if not isinstance(own.get("num_image_tokens"), int):
        raise ModelLoadError(f"{saved}: no num_image_tokens (the base crop's image tokens)")
    size = processor.size
    crop = size["shortest_edge"] if "shortest_edge" in size else min(size["height"], size["width"])
    return AnyresCount(tuple(tuple(p) for p in processor.image_grid_pinpoints), int(crop), own["num_image_tokens"],
                       int(str(own.get("vision_aspect_ratio", "anyres_max_9")).removeprefix("anyres_max_")),
                       own.get("vision_feature_select_strategy") == "default")


def check_vision_training(cfg: Config, base: VisionBase | None) -> None:
    """What training a supported vision-language base refuses, before any data or weight loads (``ConfigError``
    naming the key): the prompt objective (GRPO: not supported yet), FSDP (not supported yet),
    ``lora.train_vision`` on a text-only base, and images asked of a vision-language base whose family is not
    supported (``FAMILIES``). Packing is checked where its collator is made (``run.make_collator``: not with
    flash-attention)."""
    problems = []
    if cfg.lora.train_vision and (base is None or not base.supported):
        what = "a text-only model" if base is None else f"a {base.model_type} model, whose images are not read"
        problems.append(f"lora.train_vision: {cfg.model.name_or_path} is {what}: there is no vision tower to train"
                        + ("" if base is None else f"; images are read for {supported_families()}"))
    if base is not None and not base.supported:
        for key in ("image_dir", "image_root"):
            if getattr(cfg.data, key):
                problems.append(f"data.{key}: {cfg.model.name_or_path} is a {base.model_type} vision-language "
                                f"model, whose images this trainer does not read; supported families: "
                                f"{supported_families()} (its text rows train without data.{key})")
    if base is not None and base.supported:
        name = f"{cfg.model.name_or_path} is a vision-language model ({base.model_type})"
        if cfg.data.objective not in ("sft", "preference", "unpaired"):
            problems.append(f"data.objective: {cfg.data.objective} with {name} is not supported yet: prompt rows "
                            "(GRPO) do not carry images; train.method: sft, dpo, orpo or kto")
        if cfg.train.packing and cfg.train.method == "sft" and not base.family.packable:
            problems.append(f"train.packing: packed image rows are not supported for {name}: "
                            f"{base.family.unpackable_why}; packing is supported for "
                            + ", ".join(f.name for f in FAMILIES if f.packable) + "; set train.packing: false")
        if cfg.train.distributed == "fsdp":
            problems.append(f"train.distributed: fsdp with {name} is not supported yet; train on one process per "
                            "model (or DDP)")
    if problems:
        raise ConfigError(problems)


def tower_line(base: VisionBase | None, train_vision: bool, dtype) -> str | None:
    """The run summary's line on the vision tower, or None for a base whose images are not read."""
    if base is None or not base.supported:
        return None
    how = "LoRA on its linear layers (lora.train_vision)" if train_vision else "frozen (lora.train_vision: false)"
    return f"tower {base.tower} ({base.model_type}) not quantised, in {str(dtype).removeprefix('torch.')}; {how}"


def check_images_readable(cfg: ModelConfig, base: VisionBase | None, image_rows: int) -> None:
    """After the rows are processed: ``image_rows`` rows with images read (``ParseReport.image_rows``) for a
    vision-language base whose images this trainer does not read (each refused, ``bad_image``) -> ``ConfigError``
    saying so (not a quiet drop of every image row). A text-only base's image rows stay counted drops."""
    if base is None or base.supported or not image_rows:
        return
    raise ConfigError([f"model.name_or_path: {cfg.name_or_path} is a {base.model_type} vision-language model; "
                       f"this trainer reads images for {supported_families()} only, so the {image_rows} rows "
                       "with images were refused (bad_image); use a supported model or rows without images"])
