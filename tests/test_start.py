"""A tokenizer-only run (--stats-only, --debug-samples, --preprocess) imports neither torch, peft, bitsandbytes
nor the Trainer, and every expected failure reaches the CLI as a QloraError with its exit code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qlora_train import errors

# starts fresh CLI processes: make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

HEAVY = ("torch", "peft", "bitsandbytes", "transformers.trainer")


@pytest.mark.parametrize("flags", [["--stats-only"], ["--debug-samples", "2"], ["--preprocess"]])
def test_diagnostics_import_no_training_stack(tmp_path, qwen_tokenizer_dir, flags):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(4)))
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{name_or_path: {qwen_tokenizer_dir}, chat_template: qwen3}}\n"
                      f"data: {{datasets: [{{path: {data}}}], cache_dir: {tmp_path / 'cache'}}}\n"
                      f"train: {{output_dir: {tmp_path / 'out'}}}\n")
    probe = ("import sys\nfrom qlora_train.cli import main\n"
             f"rc = main(['--config', {str(config)!r}, *{flags!r}])\n"
             f"print('RESULT', rc, [m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.splitlines()[-1] == "RESULT 0 []", out.stderr[-2000:]


def test_every_error_the_cli_maps_is_a_qlora_error_with_its_exit_code():
    from qlora_train.data.dataset import EmptyDatasetError
    from qlora_train.data.drops import BadRowError
    from qlora_train.data.sources import SourceError
    from qlora_train.export.adapter import ExportError
    from qlora_train.train.signals import TrainingInterrupted

    codes = {cls: cls.exit_code for cls in (EmptyDatasetError, BadRowError, SourceError, errors.ModelLoadError)}
    assert set(codes.values()) == {1}
    assert errors.ConfigError(["a.b: bad"]).cli_message() == "invalid config:\n  a.b: bad"
    assert (errors.ConfigError.exit_code, ExportError.exit_code) == (2, 2)
    stop = TrainingInterrupted(15, 7, "out/checkpoint-7")
    assert isinstance(stop, errors.QloraError) and stop.exit_code == 143
    assert stop.cli_message().startswith("interrupted: stopped by SIGTERM at step 7")
