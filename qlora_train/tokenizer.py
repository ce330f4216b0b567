"""Load the tokenizer a run renders with: the configured chat template, its kwargs baked in, the configured new
tokens added, probed once.

Used by training, the diagnostics and export alike; imports neither ``datasets`` nor the model code.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from qlora_train.chat_templates import get_chat_template
from qlora_train.config import ModelConfig
from qlora_train.errors import ConfigError, ModelLoadError
from qlora_train.masking import TEMPLATE_ERRORS, call_template, check_declaration, set_image_rule, template_layout
from qlora_train.vision import image_rule_for

log = logging.getLogger(__name__)

# A control marker in a template's own text: <...> (<|im_start|>, </think>, <start_of_turn>, <｜User｜>), <<...>>,
# [WORD] or [/WORD] ([INST]), with no whitespace inside. What `model.new_tokens: auto` adds (docs/training.md).
MARKER = re.compile(r"<<[^<>\s]+>>|<[^<>\s]+>|\[/?[A-Za-z_][A-Za-z0-9_]*\]")


@dataclass(frozen=True)
class NewTokens:
    """What ``model.new_tokens`` added to the vocabulary: each token, its id, and the ids the vocabulary split its
    text into before (training starts the token's embedding row as their mean); ``already`` are the texts asked
    for that were single tokens already (nothing to add)."""

    tokens: tuple[str, ...] = ()
    ids: tuple[int, ...] = ()
    pieces: tuple[tuple[int, ...], ...] = ()
    already: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.tokens)


NO_NEW_TOKENS = NewTokens()


def load_tokenizer(cfg: ModelConfig):
    """Tokenizer with the configured chat template (the tokenizer's own by default),
    ``cfg.chat_template_kwargs`` and the declared ``cfg.template_layout`` baked in and ``cfg.new_tokens``
    added; pad token falls back to EOS.

    Raises ``ConfigError`` naming ``model.chat_template`` when the tokenizer has no
    template and none is named, or when the template file cannot be read or compiled; naming
    ``model.template_layout.<key>`` for a part that a layout does not have or a value of the wrong type.
    """
    return load_tokenizer_with_new_tokens(cfg)[0]


def load_tokenizer_with_new_tokens(cfg: ModelConfig):
    """``load_tokenizer``, and the ``NewTokens`` it added (empty without ``model.new_tokens``). For a
    vision-language base the tokenizer carries its image processor's rule (``masking.set_image_rule``,
    ``vision.image_rule_for``): every row rendered with it has its images expanded as the processor expands them."""
    declared = check_declaration(cfg.template_layout)  # before loading anything: the config's own mistake
    name = cfg.tokenizer or cfg.name_or_path
    try:
        cls = tokenizer_class(name, cfg.trust_remote_code)
        tok = cls.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(f"cannot load the tokenizer {name}: {' '.join(str(exc).split())}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    try:
        tok = get_chat_template(tok, cfg.chat_template, cfg.chat_template_kwargs, declared)
    except (OSError, *TEMPLATE_ERRORS) as exc:
        raise ConfigError([f"model.chat_template: {type(exc).__name__}: {exc}"]) from None
    check_special_tokens(tok, name)
    set_image_rule(tok, image_rule_for(cfg, tok))  # a vision-language base: its processor's rule for images
    template_layout(tok)  # probed once here; facts it cannot find stay unknown (rows then take prefix renders)
    # the markers become single tokens: the layout is probed afresh (its cache is keyed by the vocabulary)
    added = add_new_tokens(tok, new_token_texts(tok, cfg.new_tokens)) if cfg.new_tokens else NO_NEW_TOKENS
    return tok, added


_UNDEFINED = re.compile(r"'(\w+)' is undefined")
_PROBE_ROWS = ([{"role": "user", "content": "Hi."}], [{"role": "user", "content": "Hi."},
                                                     {"role": "assistant", "content": "Hello."}])


def check_special_tokens(tokenizer, name: str) -> None:
    """A chat template that uses a special token the tokenizer does not define (``bos_token + ...`` on a
    vocabulary without a BOS token) raises ``UndefinedError`` on every row: said once, here, with what to set,
    as a ``ConfigError`` (exit 2). Any other error of the template is left to the probe and the rows."""
    from jinja2.exceptions import UndefinedError

    for messages in _PROBE_ROWS:
        try:
            call_template(tokenizer.apply_chat_template, messages, tokenize=False,
                          add_generation_prompt=len(messages) == 1)
        except UndefinedError as exc:
            found = _UNDEFINED.search(str(exc))
            token = found.group(1) if found else ""
            if token not in tokenizer.SPECIAL_TOKENS_ATTRIBUTES or getattr(tokenizer, token, None) is not None:
                return
            raise ConfigError([
                f"model.chat_template: the chat template uses {token}, which the tokenizer {name} does not define "
                f"({exc}): every row would be refused. Set it for the template with model.chat_template_kwargs: "
                f'{{{token}: "..."}} (the text the model was trained with, or "" to write none), define it in the '
                "tokenizer's tokenizer_config.json, or choose a template that does not need it (model.chat_template: "
                "a shipped template's name or a .jinja file)"]) from None
        except TEMPLATE_ERRORS:
            return


def marker_pieces(text: str) -> list[str]:
    """The control markers in a piece of template text, in order (``MARKER``): maximal runs that read as
    markers; role words, whitespace and any other text around them are not markers.

    >>> marker_pieces("<|im_start|>assistant\\n")
    ['<|im_start|>']
    >>> marker_pieces("question<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n")
    ['<|eot_id|>', '<|start_header_id|>', '<|end_header_id|>']
    >>> marker_pieces("[/INST] <<SYS>>\\n### Response:")
    ['[/INST]', '<<SYS>>']
    """
    return MARKER.findall(text)


def template_markers(tokenizer) -> list[str]:
    """The markers of the tokenizer's chat template, from its probed layout (first seen first): where a user
    turn opens, the assistant header and turn openers, the answer marker and leads, the reasoning tags (when
    the template's text writes them: the layout's are a default otherwise), the end markers."""
    found = template_layout(tokenizer)
    template = tokenizer.chat_template
    source = template if isinstance(template, str) else json.dumps(template)
    think = [t for t in (found.think_open, found.think_close) if t and t in source]
    texts = [found.turn_start, found.assistant_header, *found.turn_openers, found.answer_open, *found.leads,
             *think, *found.end_markers]
    return list(dict.fromkeys(m for text in texts for m in marker_pieces(text)))


def token_count(tokenizer, text: str) -> int:
    """Tokens the vocabulary splits ``text`` into on its own."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def new_token_texts(tokenizer, option: list[str] | str) -> list[str]:
    """``model.new_tokens`` -> the texts to add: the listed ones, or with ``auto`` the template's markers
    (``template_markers``) that are not single tokens of the vocabulary. A listed text that is one token
    already stays as it is (``add_new_tokens`` records it)."""
    if option == "auto":
        return [m for m in template_markers(tokenizer) if token_count(tokenizer, m) > 1]
    return list(option)


def add_new_tokens(tokenizer, texts: list[str]) -> NewTokens:
    """Add ``texts`` to ``tokenizer`` (in place) as special tokens: matched before the vocabulary splits
    anything, so they never merge with the text beside them, and left out of decoding with
    ``skip_special_tokens``. A text that is a single token already is not added."""
    from tokenizers import AddedToken

    already = tuple(t for t in texts if token_count(tokenizer, t) == 1)
    new = [t for t in texts if t not in already]
    pieces = tuple(tuple(tokenizer.encode(t, add_special_tokens=False)) for t in new)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in new], special_tokens=True)
    ids = tuple(tokenizer.convert_tokens_to_ids(t) for t in new)
    if new:
        log.info("model.new_tokens: added %s as tokens %s", ", ".join(new), ", ".join(map(str, ids)))
    if already:
        log.info("model.new_tokens: %s already single tokens, not added", ", ".join(already))
    return NewTokens(tuple(new), ids, pieces, already)


def tokenizer_class(name: str, trust_remote_code: bool = False):
    """The class a local tokenizer's ``tokenizer_config.json`` names, taken from transformers directly, else
    ``AutoTokenizer`` (hub ids, remote code, an unknown class).

    ``AutoTokenizer`` resolves the same class, but importing it imports torch (about 2 s) through the model
    configuration classes; a tokenizer-only run (``--stats-only``, ``--debug-samples``, ``--preprocess``)
    never needs torch.
    """
    import transformers

    config = Path(name) / "tokenizer_config.json"
    if not trust_remote_code and config.is_file():
        try:
            named = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            named = {}
        cls = getattr(transformers, str(named.get("tokenizer_class")), None) if "auto_map" not in named else None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
            return cls
    return transformers.AutoTokenizer
