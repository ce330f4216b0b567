"""``--generate "prompt"`` / ``--chat``: answer with the trained model, rendered as training rendered.

The prompt becomes a user message, rendered by the tokenizer saved with the
adapter (the training template, ``chat_template_kwargs`` baked in) with the
generation prompt; decoding is greedy and stops at the end-of-turn token
(``stop_tokens``). The model is the base loaded as training loaded it (4-bit
when training was) plus the adapter, or with ``merged_dir`` the merged model
as a server would load it, with its own ``generation_config.json``.

With images (``--generate PROMPT --image PATH``, a vision-language model): the user message holds an image slot per
image before the prompt (``masking.IMAGE_SLOT``, ``ImageInfo`` with each image's size), rendered and expanded as
training renders and expands rows (``render_text``, ``expand_images`` with the tokenizer's image rule), and the
image processor makes the pixels the model reads (``prompt_inputs``).

    >>> chat_model = load_chat_model(cfg)
    >>> answer(chat_model, [{"role": "user", "content": "Say hi"}], max_new_tokens=32)
    Answer(text='Hello!', token_ids=(9707, 0, 151645), stopped=True)
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qlora_train.config import Config
from qlora_train.export.adapter import ExportError, find_adapter, fit_base_to_adapter, trained_tokenizer
from qlora_train.export.stop_tokens import eos_ids, serving_generation_config, stop_tokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatModel:
    """A model ready to answer: the model, its tokenizer, and greedy settings that stop at end of turn."""

    model: object
    tokenizer: object
    generation_config: object
    source: str  # what was loaded, for the log: "base + adapter outputs/run" or the merged directory


@dataclass(frozen=True)
class Answer:
    text: str  # what the model wrote, without the stop token
    token_ids: tuple[int, ...]  # every generated id, the stop token included
    stopped: bool  # ended at a stop token or string (False: cut at max_new_tokens)


def load_chat_model(cfg: Config, *, merged_dir: Path | None = None, checkpoint: str | None = None) -> ChatModel:
    """The merged model in ``merged_dir``, or else the base (quantised as in training) + the trained
    adapter (``checkpoint`` as in ``find_adapter``)."""
    from transformers import AutoTokenizer

    from qlora_train.masking import set_image_rule
    from qlora_train.train.model import load_base_model, model_class, resolve_runtime
    from qlora_train.vision import image_rule_for, vision_base

    runtime = resolve_runtime(cfg)
    if merged_dir is not None:
        if not (Path(merged_dir) / "config.json").is_file():
            raise ExportError(f"no merged model in {merged_dir}: run --merge first (or drop --merged)")
        remote = cfg.model.trust_remote_code
        tokenizer = AutoTokenizer.from_pretrained(merged_dir, trust_remote_code=remote)
        merged_cfg = cfg.model.model_copy(update={"name_or_path": str(merged_dir)})
        vision = vision_base(merged_cfg)
        set_image_rule(tokenizer, image_rule_for(merged_cfg, tokenizer, vision))  # its own image processor
        model = model_class(vision).from_pretrained(merged_dir, dtype=runtime.compute_dtype,
                                                    device_map=runtime.device_map, trust_remote_code=remote)
        gen, source = model.generation_config, f"merged model {merged_dir}"
    else:
        from peft import PeftModel

        from qlora_train.train.resume import refusing_unsafe_files

        adapter_dir = find_adapter(cfg.train.output_dir, checkpoint)
        tokenizer = trained_tokenizer(adapter_dir, cfg.model)
        saved = (adapter_dir / "preprocessor_config.json").is_file()  # the image processor training used
        set_image_rule(tokenizer, image_rule_for(cfg.model, tokenizer, processor_path=adapter_dir if saved else None))
        base = load_base_model(cfg.model, runtime)
        with refusing_unsafe_files(adapter_dir, "the trained adapter"):
            fit_base_to_adapter(base, adapter_dir, tokenizer)  # rows for the tokens model.new_tokens added
            model = PeftModel.from_pretrained(base, adapter_dir)
        gen, source = serving_generation_config(base.generation_config, tokenizer), f"base + adapter {adapter_dir}"
    model.eval()
    return ChatModel(model, tokenizer, greedy(gen), source)


def greedy(gen):
    """A copy of a ``GenerationConfig`` that decodes greedily (its sampling settings cleared)."""
    gen = copy.deepcopy(gen)
    gen.do_sample, gen.temperature, gen.top_p, gen.top_k, gen.min_p = False, None, None, None, None
    return gen


def user_message(prompt: str, images: list[str] = ()) -> dict:
    """A prompt (and image paths, read for their sizes) -> the user message: an image slot per image before the
    text, with its ``ImageInfo`` (``ExportError`` for an image that cannot be read)."""
    from qlora_train.data.images import ImageUnreadable, upright_size
    from qlora_train.masking import IMAGE_SLOT

    if not images:
        return {"role": "user", "content": prompt}
    infos = []
    for path in images:
        ref = str(Path(path).resolve())
        try:
            width, height = upright_size(ref)  # EXIF orientation applied, as training reads an image
        except ImageUnreadable as exc:
            raise ExportError(f"--image {path}: cannot read it: {exc}") from None
        infos.append({"ref": ref, "width": width, "height": height})
    return {"role": "user", "content": IMAGE_SLOT * len(images) + prompt, "images": infos}


def prompt_inputs(tok, messages: list[dict]) -> dict:
    """The model's inputs for the next assistant turn: the ids of the generation-prompt render, and for messages
    with images (a vision-language model's tokenizer) each image expanded into its tokens as training expands it,
    with its pixels (``pixel_values``; ``image_grid_thw`` for the Qwen-VL families) and the rule's ``type_ids``
    input marking the image tokens."""
    import torch

    from qlora_train.data.images import open_image
    from qlora_train.masking import RowRejected, expanded_text, image_rule, message_images, render_text

    images = message_images(messages)
    if not images:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return dict(tok(prompt, add_special_tokens=False, return_tensors="pt"))
    rule = image_rule(tok)
    if rule is None:
        raise ExportError("--image: the model is not a vision-language model whose images this trainer reads")
    try:
        text = expanded_text(render_text(messages, tok, add_generation_prompt=True), images, rule)
    except RowRejected as rej:
        raise ExportError(f"--image: {rej.detail}") from None
    inputs = dict(tok(text, add_special_tokens=False, return_tensors="pt"))
    if rule.layout is not None:  # a structured expansion's family: its images batched its own way
        inputs.update(rule.layout.batch_pixels([
            rule.image_processor(images=[open_image(im["ref"])], return_tensors="pt", **rule.layout.pixel_kwargs)
            for im in images]))
        return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    opened = [open_image(im["ref"]) for im in images]
    # LLaVA-OneVision's processor reads a row's images as one sample (image_sizes, batch_num_images)
    pixels = rule.image_processor(images=[opened] if rule.counter is not None else opened, return_tensors="pt")
    inputs["pixel_values"] = pixels["pixel_values"]
    if rule.type_ids:
        inputs[rule.type_ids] = (inputs["input_ids"] == rule.image_token_id).int()
    for key in ("image_sizes", "batch_num_images"):
        if key in pixels:
            inputs[key] = torch.as_tensor(pixels[key])
    if "image_grid_thw" in pixels:
        inputs["image_grid_thw"] = pixels["image_grid_thw"]
    return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def answer(chat: ChatModel, messages: list[dict], *, max_new_tokens: int = 256) -> Answer:
    """Conversation -> the model's next assistant turn (greedy, stopping at the end-of-turn token)."""
    import torch

    tok = chat.tokenizer
    inputs = {k: v.to(chat.model.device) for k, v in prompt_inputs(tok, messages).items()}
    strings = list(stop_tokens(tok).strings)
    gen = copy.deepcopy(chat.generation_config)
    gen.max_new_tokens, gen.stop_strings = max_new_tokens, strings or None
    with torch.no_grad():
        out = chat.model.generate(**inputs, generation_config=gen, tokenizer=tok if strings else None)
    ids = tuple(out[0, inputs["input_ids"].shape[1]:].tolist())
    eos = set(eos_ids(chat.generation_config))
    text = tok.decode(ids, skip_special_tokens=False)
    if ids and ids[-1] in eos:
        return Answer(tok.decode(ids[:-1], skip_special_tokens=False), ids, True)
    ending = next((s for s in strings if text.endswith(s)), None)
    if ending:
        return Answer(text[: -len(ending)], ids, True)
    return Answer(text, ids, False)


def say(chat: ChatModel, messages: list[dict], *, max_new_tokens: int, write: Callable[[str], None]) -> Answer:
    """Answer, write the text, and warn when it was cut at ``max_new_tokens`` instead of ending."""
    reply = answer(chat, messages, max_new_tokens=max_new_tokens)
    write(reply.text)
    if not reply.stopped:
        log.warning("no end-of-turn token within %d new tokens: the answer was cut (raise --max-new-tokens, or "
                    "train longer if it never ends)", max_new_tokens)
    return reply


def chat_loop(chat: ChatModel, *, max_new_tokens: int, read: Callable[[str], str] = input,
              write: Callable[[str], None] = print) -> None:
    """Alternate user lines and answers, keeping the conversation; an empty line or end of input stops."""
    messages: list[dict] = []
    while True:
        try:
            line = read("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = say(chat, messages, max_new_tokens=max_new_tokens, write=write)
        messages.append({"role": "assistant", "content": reply.text})


def try_model(cfg: Config, *, prompt: str | None, chat: bool, merged_dir: Path | None, checkpoint: str | None,
              max_new_tokens: int, images: list[str] = ()) -> None:
    """``--generate PROMPT [--image PATH ...]``: print the answer; ``--chat``: a conversation on stdin/stdout."""
    from transformers import set_seed

    set_seed(cfg.train.seed)
    model = load_chat_model(cfg, merged_dir=merged_dir, checkpoint=checkpoint)
    log.info("answering with the %s (greedy, stops at %s)", model.source,
             ", ".join(model.tokenizer.convert_ids_to_tokens(eos_ids(model.generation_config))))
    if chat:
        chat_loop(model, max_new_tokens=max_new_tokens)
    else:
        say(model, [user_message(prompt, images)], max_new_tokens=max_new_tokens,
            write=lambda text: print(text, file=sys.stdout, flush=True))
