"""The demo targets: each trains only where its finished run is not there, and run again says where it is (exit 0).

``make`` runs the repository's Makefile in a scratch directory with a stand-in ``qlora-train`` on the PATH that
records its calls, writes the run's marker, and refuses (exit 2, as the real one does) a directory that holds a
finished run; the tiny models' configs stand in for ``python -m qlora_train.tiny``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAKE = """#!/bin/sh
# qlora-train --config configs/NAME.yaml: the run's output_dir is outputs/NAME
name=$(basename "$2" .yaml)
echo "$name" >> calls.log
if [ -e "outputs/$name/training_complete.json" ]; then echo "error: outputs/$name holds a finished run" >&2; exit 2; fi
mkdir -p "outputs/$name" && touch "outputs/$name/training_complete.json"
"""
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


@pytest.fixture
def scratch(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "qlora-train").write_text(FAKE)
    (bin_dir / "qlora-train").chmod(0o755)
    for model in ("tiny-qwen3", "tiny-qwen2.5-vl", "tiny-qwen3-agent"):
        (tmp_path / ".cache" / model).mkdir(parents=True)
        (tmp_path / ".cache" / model / "config.json").write_text("{}")
    return tmp_path


def make(where: Path, target: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{where / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["make", "--no-print-directory", "-f", str(REPO / "Makefile"), target], cwd=where, env=env,
                          capture_output=True, text=True, timeout=60)


def calls(where: Path) -> list[str]:
    log = where / "calls.log"
    return log.read_text().split() if log.exists() else []


def vl_again(kind: str, run: str) -> str:
    """What a vision-language demo says when its run is there: the family, and the line that trains it again."""
    return (f"the vision-language {kind}demo's finished run (qwen2.5-vl) is in outputs/{run} (again from step 0: "
            f"qlora-train --config configs/{run}.yaml --set model.name_or_path=.cache/tiny-qwen2.5-vl "
            f"--set model.chat_template=qwen2.5-vl --set train.output_dir=outputs/{run} --overwrite)")


def again_line(name: str, run: str) -> str:
    return f"the {name} demo's finished run is in outputs/{run} (again from step 0: " \
           f"qlora-train --config configs/{run}.yaml --overwrite)"


@pytest.mark.parametrize("target, runs, said", [
    ("demo", ["quickstart"], again_line("SFT", "quickstart")),
    ("demo-dpo", ["quickstart", "quickstart-dpo"], again_line("DPO", "quickstart-dpo")),
    ("demo-kto", ["quickstart", "quickstart-kto"], again_line("KTO", "quickstart-kto")),
    ("demo-grpo", ["quickstart", "quickstart-grpo"], again_line("GRPO", "quickstart-grpo")),
    ("demo-agent", ["quickstart-agent"], again_line("agent", "quickstart-agent") + "\na prompt row and a scripted "
     "example rollout, its generated and tool tokens marked: qlora-train --config configs/quickstart-agent.yaml "
     "--debug-samples 2"),
    ("demo-vl", ["quickstart-vl"], vl_again("", "quickstart-vl")),
    ("demo-vl-dpo", ["quickstart-vl-dpo"], vl_again("DPO ", "quickstart-vl-dpo")),
    ("demo-vl-kto", ["quickstart-vl-kto"], vl_again("KTO ", "quickstart-vl-kto")),
])
def test_a_demo_run_again_says_where_its_finished_run_is(scratch, target, runs, said):
    first = make(scratch, target)
    assert first.returncode == 0, first.stderr
    assert calls(scratch) == runs
    again = make(scratch, target)
    assert again.returncode == 0, again.stderr
    assert calls(scratch) == runs  # nothing trained again
    assert again.stdout == said + "\n"


def test_the_preference_demos_start_from_the_sft_demo_once(scratch):
    for target in ("demo-dpo", "demo-kto", "demo"):
        assert make(scratch, target).returncode == 0
    assert calls(scratch) == ["quickstart", "quickstart-dpo", "quickstart-kto"]
    os.utime(scratch / "outputs/quickstart/training_complete.json")  # the SFT run newer than theirs: no reason
    assert make(scratch, "demo-dpo").returncode == 0
    assert calls(scratch) == ["quickstart", "quickstart-dpo", "quickstart-kto"]
