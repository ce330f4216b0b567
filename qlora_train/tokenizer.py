"""Load the tokenizer a run renders with: the configured chat template, its kwargs baked in, probed once.

Used by training, the diagnostics and export alike; imports neither ``datasets`` nor the model code.
"""

from __future__ import annotations

from qlora_train.chat_templates import get_chat_template
from qlora_train.config import ModelConfig
from qlora_train.data.layout import template_layout
from qlora_train.errors import ConfigError, ModelLoadError


def load_tokenizer(cfg: ModelConfig):
    """Tokenizer with the configured chat template (the tokenizer's own by default) and
    ``cfg.chat_template_kwargs`` baked in; pad token falls back to EOS.

    Raises ``ConfigError`` naming ``model.chat_template`` when the tokenizer has no
    template and none is named, or when the template cannot be probed.
    """
    from transformers import AutoTokenizer

    name = cfg.tokenizer or cfg.name_or_path
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(f"cannot load the tokenizer {name}: {' '.join(str(exc).split())}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    try:
        tok = get_chat_template(tok, cfg.chat_template, cfg.chat_template_kwargs)
        template_layout(tok)  # probed once here: a template that cannot be used is a config error, not a row's
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError([f"model.chat_template: {type(exc).__name__}: {exc}"]) from None
    return tok
