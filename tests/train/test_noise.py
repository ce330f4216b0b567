"""The library messages a user can do nothing about are silenced by their exact text, and nothing beside them."""

from __future__ import annotations

import logging
import warnings

from qlora_train.train.noise import BNB_CPU_LOGGER, silence_library_noise

BNB_FORMAT = ("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip "
              "install kernels` and the kernels >= 0.11.1")  # bitsandbytes/backends/cpu/ops.py, 0.50


def test_only_the_missing_kernels_package_is_dropped_from_bitsandbytes_log(caplog):
    silence_library_noise()
    silence_library_noise()  # idempotent: one filter
    logger = logging.getLogger(BNB_CPU_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=BNB_CPU_LOGGER):
        logger.warning(BNB_FORMAT, ModuleNotFoundError("No module named 'kernels'"))
        logger.warning(BNB_FORMAT, RuntimeError("kernels 0.10 is too old"))
        logger.warning("another bitsandbytes warning")
    assert [r.getMessage()[len("Failed to load CPU gemm_4bit_forward from kernels-community: "):]
            if r.getMessage().startswith("Failed") else r.getMessage() for r in caplog.records] == [
        "kernels 0.10 is too old. Please make sure you already `pip install kernels` and the kernels >= 0.11.1",
        "another bitsandbytes warning"]


def test_only_pefts_deprecated_gradient_checkpointing_calls_are_silenced():
    def warn(message: str, module: str = "transformers.modeling_utils", category=FutureWarning) -> None:
        warnings.warn_explicit(message, category, filename=module.replace(".", "/") + ".py", lineno=1, module=module)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_library_noise()
        warn("`gradient_checkpointing_enable` is deprecated and will be removed in v6. Use "
             "`activation_checkpointing_enable` instead.")
        warn("`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing` "
             "instead.")
        warn("`save_pretrained` is deprecated and will be removed in v6.")  # another deprecation: shown
        warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", module="mylib")  # elsewhere
        warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", category=UserWarning)
    assert [(str(w.message), w.category) for w in seen] == [
        ("`save_pretrained` is deprecated and will be removed in v6.", FutureWarning),
        ("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning),
        ("`is_gradient_checkpointing` is deprecated and will be removed in v6.", UserWarning)]


def test_only_transformers_unactionable_lines_are_dropped():
    """The cache turned off under gradient checkpointing (every vision-language run) and checkpoint times that look
    unreliable (rotating checkpoints saved within a second): transformers 5's texts, logged by these loggers."""
    silence_library_noise()
    lines = {
        "transformers.utils.generic": [
            "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`.",
            "`Unexpected select feature strategy: x"],
        "transformers.modeling_layers": [
            "Caching is incompatible with gradient checkpointing in Qwen2DecoderLayer. Setting `use_cache=False`.",
            "another layer warning"],
        "transformers.trainer_utils": [
            "mtime may not be reliable on this filesystem, falling back to numerical ordering",
            "mtime is fine"],
    }
    kept: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: kept.append(record.getMessage())
    for name, messages in lines.items():
        logger = logging.getLogger(name)
        logger.addHandler(handler)  # on the logger itself: transformers' loggers need not reach the root's
        try:
            for message in messages:
                logger.warning(message)
        finally:
            logger.removeHandler(handler)
    assert kept == ["`Unexpected select feature strategy: x", "another layer warning", "mtime is fine"]
