"""Load the tokenizer a run renders with: the configured chat template, its kwargs baked in, probed once.

Used by training, the diagnostics and export alike; imports neither ``datasets`` nor the model code.
"""

from __future__ import annotations

import json
from pathlib import Path

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
    name = cfg.tokenizer or cfg.name_or_path
    try:
        cls = tokenizer_class(name, cfg.trust_remote_code)
        tok = cls.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
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
