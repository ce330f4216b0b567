"""Library messages a user can do nothing about, silenced by their exact text and nothing else.

- bitsandbytes, on a CPU with AVX512-BF16, tries at import an optional hub kernel (the ``kernels`` package) and
  logs a warning when that package is not installed; it falls back to its own CPU kernels, which training uses
  anyway (``model.keep_4bit_layout``). Only that record with ``No module named 'kernels'`` is dropped: a
  ``kernels`` that is installed and fails still speaks.
- peft (``prepare_model_for_kbit_training``, ``get_peft_model``) calls transformers 5's deprecated gradient
  checkpointing aliases; each call warns with a ``FutureWarning`` from ``transformers.modeling_utils``.
- transformers says, on every vision-language run with gradient checkpointing (``train.gradient_checkpointing``,
  the default), that it turns the model's cache off (``use_cache=True is incompatible …``, or per layer
  ``Caching is incompatible …``): training never uses the cache, there is nothing to change.
- the Trainer, rotating checkpoints (``train.save_total_limit``) written less than a second apart, says that their
  modification times look unreliable and it orders them by step instead, which is what it should do anyway.
"""

from __future__ import annotations

import logging
import warnings

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
NO_KERNELS_PACKAGE = "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'"
# (message regex, the module that warns): peft's calls of transformers' deprecated aliases
DEPRECATED_ALIASES = (
    (r"`gradient_checkpointing_enable` is deprecated and will be removed in v6", r"transformers\.modeling_utils"),
    (r"`is_gradient_checkpointing` is deprecated and will be removed in v6", r"transformers\.modeling_utils"),
)
# logger -> the start of the records it logs that are dropped (transformers 5's texts)
LOGGED_NOISE = {
    BNB_CPU_LOGGER: (NO_KERNELS_PACKAGE,),
    "transformers.utils.generic": (
        "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`.",),
    "transformers.modeling_layers": ("Caching is incompatible with gradient checkpointing in ",),
    "transformers.trainer_utils": (
        "mtime may not be reliable on this filesystem, falling back to numerical ordering",),
}


class _DropNoise(logging.Filter):
    """Drops a logger's records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def silence_library_noise() -> None:
    """Drop the messages above (idempotent). Must run before bitsandbytes is imported: its warning is logged
    while its CPU backend loads."""
    for name, starts in LOGGED_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(starts))
    for message, module in DEPRECATED_ALIASES:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)
