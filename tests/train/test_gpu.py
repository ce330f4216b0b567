"""CUDA only: a few 4-bit steps with bf16 and the paged 8-bit optimizer (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from qlora_train.config import load_config
from qlora_train.train.run import train
from tests.train.test_train_e2e import write_config

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_bf16_paged_8bit(tmp_path, tiny_model_dir):
    cfg = load_config(write_config(tmp_path, tiny_model_dir, max_steps=3, optim="paged_adamw_8bit"))
    trainer = train(cfg)
    assert trainer.args.optim.value == "paged_adamw_8bit" and trainer.args.bf16
    assert trainer.state.global_step == 3
