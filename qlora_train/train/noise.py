"""Library messages a user can do nothing about, silenced by their exact text and nothing else.

- bitsandbytes, on a CPU with AVX512-BF16, tries at import an optional hub kernel (the ``kernels`` package) and
  logs a warning when that package is not installed; it falls back to its own CPU kernels, which training uses
  anyway (``model.keep_4bit_layout``). Only that record with ``No module named 'kernels'`` is dropped: a
  ``kernels`` that is installed and fails still speaks.
- peft (``prepare_model_for_kbit_training``, ``get_peft_model``) calls transformers 5's deprecated gradient
  checkpointing aliases; each call warns with a ``FutureWarning`` from ``transformers.modeling_utils``.
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


def _not_the_missing_kernels_package(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(NO_KERNELS_PACKAGE)


def silence_library_noise() -> None:
    """Drop the messages above (idempotent). Must run before bitsandbytes is imported: its warning is logged
    while its CPU backend loads."""
    logger = logging.getLogger(BNB_CPU_LOGGER)
    if _not_the_missing_kernels_package not in logger.filters:
        logger.addFilter(_not_the_missing_kernels_package)
    for message, module in DEPRECATED_ALIASES:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)
