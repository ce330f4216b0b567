"""``train.distributed: fsdp``: the guards that stop a run before any weight loads (fast), and FSDP2 on 2 CPU
processes (gloo, float32) against one process with the same global batch (slow)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from qlora_train.cli import main
from qlora_train.config import load_config
from qlora_train.errors import ConfigError
from qlora_train.train.distributed import check_distributed_setup, fsdp_setup_problem, quant_storage_dtype
from qlora_train.train.model import resolve_runtime

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "configs" / "data" / "quickstart.jsonl"
QUICKSTART = REPO / "configs" / "quickstart.yaml"
QUICKSTART_FSDP = REPO / "configs" / "quickstart-fsdp.yaml"


def guard_config(tmp_path, **overrides) -> Path:
    """A config the guards refuse before loading anything (the model directory need not hold a model)."""
    (tmp_path / "model").mkdir(exist_ok=True)
    cfg = {"model": {"name_or_path": str(tmp_path / "model"), "chat_template": "qwen3"},
           "data": {"datasets": [{"path": str(SAMPLE)}]},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none", "distributed": "fsdp"}}
    for key, value in overrides.items():
        section, name = key.split("__")
        cfg[section][name] = value
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_auto_storage_is_the_compute_dtype_under_fsdp_only():
    assert quant_storage_dtype("auto", "fsdp", torch.bfloat16) is torch.bfloat16
    assert quant_storage_dtype("auto", "ddp", torch.bfloat16) is torch.uint8
    assert quant_storage_dtype("float16", "ddp", torch.bfloat16) is torch.float16
    assert fsdp_setup_problem(storage=torch.bfloat16, compute_dtype=torch.bfloat16, mixed_precision="bf16",
                              quantized=True) is None
    assert fsdp_setup_problem(storage=torch.uint8, compute_dtype=torch.bfloat16, mixed_precision="bf16",
                              quantized=False) is None  # a 16-bit base has no 4-bit storage


@pytest.mark.parametrize(("overrides", "env", "line"), [
    ({"model__bnb_4bit_quant_storage": "uint8"}, {},
     "model.bnb_4bit_quant_storage: uint8 storage cannot be sharded by FSDP (each rank would keep every 4-bit "
     "weight whole, accelerate #3983); set model.bnb_4bit_quant_storage: auto"),
    ({"model__bnb_4bit_quant_storage": "bfloat16"}, {},  # CPU computes in float32
     "model.bnb_4bit_quant_storage: bfloat16 differs from the compute dtype float32; FSDP needs the 4-bit storage "
     "dtype to equal it: set model.bnb_4bit_quant_storage: auto"),
    ({}, {"ACCELERATE_MIXED_PRECISION": "bf16"},
     "mixed precision bf16: FSDP would gather the float32-stored 4-bit weights in bfloat16, which corrupts them; "
     "launch without --mixed_precision (and mixed_precision: 'no' in an accelerate config): model.compute_dtype "
     "sets it"),
    ({}, {},
     "train.distributed: fsdp needs a launcher: torchrun --nproc_per_node N -m qlora_train.cli ... (or accelerate "
     "launch --config_file configs/accelerate/fsdp2.yaml -m qlora_train.cli ...)"),
    ({"train__distributed": "ddp"}, {"ACCELERATE_USE_FSDP": "true"},
     "train.distributed: ddp, but the accelerate config launches FSDP; set train.distributed: fsdp (or launch with "
     "a config without distributed_type: FSDP)"),
    ({"train__distributed": "ddp"}, {"ACCELERATE_USE_DEEPSPEED": "true"},
     "the accelerate config launches DeepSpeed, which this trainer does not support with 4-bit weights; use "
     "train.distributed: fsdp (docs/distributed.md#deepspeed-zero-3)"),
    ({"train__fsdp_cpu_offload": True}, {},
     "train.fsdp_cpu_offload: moves GPU memory to the CPU; without a CUDA device there is nothing to offload: set it "
     "to false"),
    ({"model__load_in_4bit": False, "model__load_in_8bit": True}, {},
     "model.load_in_8bit: FSDP cannot shard 8-bit weights; use load_in_4bit: true (or train.distributed: ddp)"),
], ids=["uint8-storage", "storage-not-compute-dtype", "param-dtype-not-storage", "no-launcher",
        "accelerate-fsdp-launch-with-ddp", "deepspeed", "cpu-offload-without-cuda", "8-bit"])
def test_each_guard_exits_2_with_its_line_before_loading(tmp_path, monkeypatch, capsys, overrides, env, line):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the lines name CPU's float32
    for key in ("LOCAL_RANK", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["--config", str(guard_config(tmp_path, **overrides))]) == 2  # the model directory is empty
    problems = capsys.readouterr().err.splitlines()[1:]
    assert problems == [f"  {line}"]


def test_the_storage_guards_come_first_and_are_config_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = load_config(guard_config(tmp_path, model__bnb_4bit_quant_storage="uint8"))
    with pytest.raises(ConfigError) as err:
        check_distributed_setup(cfg, resolve_runtime(cfg), env={})
    assert err.value.exit_code == 2 and err.value.problems[0].startswith("model.bnb_4bit_quant_storage: uint8")
    cfg.model.bnb_4bit_quant_storage = "auto"
    check_distributed_setup(cfg, resolve_runtime(cfg), env={"LOCAL_RANK": "0"})  # float32 storage: fine


def test_new_tokens_are_refused_under_fsdp():
    from qlora_train.tokenizer import NO_NEW_TOKENS, NewTokens
    from qlora_train.train.distributed import check_new_tokens

    added = NewTokens(("<|zz|>",), (151669,), ((27, 91),))
    with pytest.raises(ConfigError) as err:
        check_new_tokens("fsdp", added)
    assert err.value.exit_code == 2 and err.value.problems == [
        "model.new_tokens: adding tokens is not available with train.distributed: fsdp (peft's trainable token rows "
        "do not shard); use train.distributed: ddp"]
    check_new_tokens("ddp", added)
    check_new_tokens("fsdp", NO_NEW_TOKENS)


# Under torchrun: the forward of the 4-bit + LoRA model (an adapter that adds to the output) before and after
# accelerate's FSDP2 sharding, and the 4-bit weight bytes rank 0 then holds; rank 0 writes them to argv[2].
FORWARD_PROBE = """
import json, os, sys
import torch
from transformers import Trainer, set_seed
from qlora_train.config import load_config
from qlora_train.train.distributed import local_and_full_bytes, with_fsdp
from qlora_train.train.model import load_model, resolve_runtime
from qlora_train.train.run import training_arguments

cfg = load_config(sys.argv[1], sys.argv[3:])
runtime = resolve_runtime(cfg)
args = training_arguments(cfg, runtime, has_eval=False)
set_seed(cfg.train.seed)  # every rank builds the same adapter, as train() does: FSDP2 shards what each rank has
model = load_model(cfg, runtime).eval()
with torch.no_grad():
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.normal_(std=0.05)  # so that the adapter adds to the output
trainer = with_fsdp(Trainer)(model=model, args=args)
ids = torch.randint(0, 150000, (2, 24), generator=torch.Generator().manual_seed(0)).to(args.device)
with torch.no_grad(), trainer.autocast_smart_context_manager():
    whole = model(input_ids=ids).logits.float().cpu()
optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
sharded, _ = trainer.accelerator.prepare(model, optimizer)  # accelerate's FSDP2 wants both
with torch.no_grad(), trainer.autocast_smart_context_manager():
    split = sharded(input_ids=ids).logits.float().cpu()
local, full = local_and_full_bytes(sharded)
if os.environ["RANK"] == "0":
    json.dump({"max_diff": (whole - split).abs().max().item(), "nan": bool(split.isnan().any()), "local": local,
               "full": full, "storage": str(runtime.quant_storage).removeprefix("torch.")}, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs a CUDA GPU")]),
])
def test_sharded_forward_equals_the_unsharded_one(tmp_path, tiny_model_dir, device):
    """CPU: float32 storage, bit-identical logits. CUDA: bfloat16 storage (the compute dtype), FSDP's param_dtype
    bfloat16, on every GPU of the machine up to 2: the same logits to bfloat16 precision, and no NaN (the bit
    patterns of bf16-stored nf4 bytes that FSDP2 must not canonicalise, bitsandbytes #1945)."""
    nproc = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    result = tmp_path / "forward.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "probe.py").write_text(FORWARD_PROBE)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", "29544", str(tmp_path / "probe.py"), str(QUICKSTART_FSDP), str(result),
                           f"model.name_or_path={tiny_model_dir}", f"train.output_dir={tmp_path / 'out'}"],
                          cwd=REPO / "configs", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(result.read_text())
    assert got["storage"] == ("float32" if device == "cpu" else "bfloat16") and not got["nan"]
    assert got["max_diff"] <= (0.0 if device == "cpu" else 2e-2)
    assert got["local"] * nproc == got["full"] > 0  # rank 0 holds 1/N of the 4-bit bytes


# ---- 2 processes (FSDP2, gloo) against one process with their global batch --------------------------------------

BYTES_LINE = re.compile(r"fsdp: 4-bit weight bytes per rank ([\d,]+) \([\d.]+%\), ([\d,]+) \([\d.]+%\) of ([\d,]+) "
                        r"unsharded")


def packed_config(tmp_path, model_dir, name: str, **train) -> Path:
    """48 rows packed into 128-token sequences (22 of them), 2 micro-batches per step, the model's own loss and no
    gradient checkpointing, an eval split (its loss is logged); 7 steps: the epoch's 6th ends with one micro-batch."""
    cfg = {"model": {"name_or_path": str(model_dir), "chat_template": "qwen3"},
           "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
           "data": {"datasets": [{"path": str(SAMPLE)}], "max_length": 128, "eval_fraction": 0.25},
           "train": {"output_dir": str(tmp_path / name), "max_steps": 7, "save_steps": 7, "eval_steps": 7,
                     "logging_steps": 1, "report_to": "none", "lr_scheduler": "constant", "warmup_ratio": 0.0,
                     "learning_rate": 5e-3, "packing": True, "packing_length": 128, "gradient_accumulation_steps": 2,
                     "fused_loss": False, "gradient_checkpointing": False, **train}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


QUICK_STEPS, QUICK_CHECKPOINT = 14, 7


def quickstart_overrides(tmp_path, model_dir, name: str) -> list[str]:
    """The shipped quickstarts on the tiny model, no eval split, 45 of its rows: 11 whole steps of 4 rows and a
    ragged 12th of 1 (on 2 ranks: rank 0's batch half blank, rank 1's all blank), then 2 steps into the second
    epoch; a checkpoint after step 7."""
    return [f"model.name_or_path={model_dir}", f"train.output_dir={tmp_path / name}",
            f"train.max_steps={QUICK_STEPS}", f"train.save_steps={QUICK_CHECKPOINT}", "train.logging_steps=1",
            "data.eval_fraction=0.0", "data.max_samples=45"]


def torchrun(port: int, *args: str, log: Path, program: tuple[str, ...] = ("-m", "qlora_train.cli"),
             stdout=subprocess.DEVNULL) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",  # float32 on CPU, also on a GPU machine
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(port), *program, *args], cwd=REPO / "configs", env=env,
                            stdout=stdout, stderr=log.open("w"), text=True)


# The CLI with a callback that says (rank 0, on stdout) when a checkpoint is saved, and pauses after the step
# after it (argv[1] + 1), so that a SIGTERM sent on "saved <argv[1]>" arrives during that step.
PACED_CLI = """
import sys, time
from transformers import TrainerCallback
import qlora_train.train.run as run
from qlora_train.cli import main

class Pace(TrainerCallback):
    def on_save(self, args, state, control, **kw):
        if args.process_index == 0:
            print(f"saved {state.global_step}", flush=True)
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == int(sys.argv[1]) + 1:
            time.sleep(3)

real_train = run.train
run.train = lambda cfg, **kw: real_train(cfg, callbacks=[Pace()], **kw)
sys.exit(main(sys.argv[2:]))
"""


def finish(proc: subprocess.Popen, log: Path) -> str:
    proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    return text


def logged(out: Path, key: str = "loss") -> dict[int, float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h[key] for h in history if key in h}


def adapter(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "adapter_model.safetensors")


def assert_same_adapter(a: dict, b: dict, atol: float) -> float:
    assert a.keys() == b.keys() and a
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol
    return worst


@pytest.mark.slow
def test_fsdp_on_two_processes_is_the_one_process_run(tmp_path, tiny_model_dir, monkeypatch):
    """configs/quickstart-fsdp.yaml (padded rows, the fused loss and gradient checkpointing: its defaults) on 2
    ranks x 2 rows, and a packed run (2 micro-batches per step, the model's own loss, eval) on 2 ranks x 1 sequence:
    the same losses as one process with 4 rows / 2 sequences, within 1e-5 in float32, and the same adapter, which
    loads on one process; each rank holds half of the 4-bit weight bytes; the quickstart stopped by SIGTERM after a
    checkpoint saves one and, resumed from it, ends at the same adapter."""
    from qlora_train.train.run import train

    monkeypatch.chdir(REPO / "configs")  # the quickstarts' data path is relative to it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the one-process runs: float32 on CPU too
    logs = {name: tmp_path / f"{name}.log" for name in ("quick", "packed", "stopped", "resumed")}
    quick = torchrun(29541, "--config", str(QUICKSTART_FSDP), *(
        arg for o in quickstart_overrides(tmp_path, tiny_model_dir, "quick") for arg in ("--set", o)),
        log=logs["quick"])
    packed = torchrun(29542, "--config", str(packed_config(tmp_path, tiny_model_dir, "packed", distributed="fsdp",
                                                           per_device_train_batch_size=1)), log=logs["packed"])
    one = {"quick": train(load_config(QUICKSTART, quickstart_overrides(tmp_path, tiny_model_dir, "quick-one"))),
           "packed": train(load_config(packed_config(tmp_path, tiny_model_dir, "packed-one",
                                                     per_device_train_batch_size=2)))}
    stderr = {"quick": finish(quick, logs["quick"]), "packed": finish(packed, logs["packed"])}

    # SIGTERM to torchrun (it passes it on to the ranks) once the step-7 checkpoint is saved: every rank stops
    # after step 8 with a checkpoint; the run then resumed from it, across the ragged step 12
    (tmp_path / "paced.py").write_text(PACED_CLI)
    overrides = [*quickstart_overrides(tmp_path, tiny_model_dir, "resumed"), "train.resume_from_checkpoint=auto"]
    config = ["--config", str(QUICKSTART_FSDP), *(arg for o in overrides for arg in ("--set", o))]
    stopped = torchrun(29543, str(QUICK_CHECKPOINT), *config, log=logs["stopped"],
                       program=(str(tmp_path / "paced.py"),), stdout=subprocess.PIPE)
    for line in stopped.stdout:
        if line.strip() == f"saved {QUICK_CHECKPOINT}":
            stopped.send_signal(signal.SIGTERM)
            break
    stopped.communicate(timeout=300)
    stop_line = (f"interrupted: stopped by SIGTERM at step {QUICK_CHECKPOINT + 1}; checkpoint saved to "
                 f"{tmp_path / 'resumed' / f'checkpoint-{QUICK_CHECKPOINT + 1}'}")
    assert stopped.returncode != 0 and logs["stopped"].read_text().count(stop_line) == 2  # each rank's
    assert not (tmp_path / "resumed" / "adapter_model.safetensors").exists()
    resumed = torchrun(29545, *config, log=logs["resumed"])

    for name, trainer in one.items():
        want, got = logged(Path(trainer.args.output_dir)), logged(tmp_path / name)
        assert want.keys() == got.keys() == set(range(1, trainer.args.max_steps + 1)), name
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=0, abs=1e-5), (name, step)
        worst = assert_same_adapter(adapter(Path(trainer.args.output_dir)), adapter(tmp_path / name), atol=1e-5)
        print(f"{name}: losses differ by <= {max(abs(got[s] - want[s]) for s in want):.2e}, adapter by {worst:.2e}")
    assert logged(tmp_path / "packed", "eval_loss").keys() == {7}
    assert "fsdp: 4-bit weight bytes per rank" in stderr["packed"]

    rank0, rank1, whole = (int(n.replace(",", "")) for n in BYTES_LINE.search(stderr["quick"]).groups())
    assert rank0 + rank1 == whole > 0 and max(rank0, rank1) <= 0.55 * whole
    print(f"4-bit weight bytes per rank {rank0:,} / {rank1:,} of {whole:,}")

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "quick")
    saved = adapter(tmp_path / "quick")
    lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert len(lora) == len(saved)
    for name, tensor in saved.items():
        key = name.replace(".weight", ".default.weight")
        torch.testing.assert_close(lora[key], tensor, rtol=0, atol=0)

    finish(resumed, logs["resumed"])
    assert logged(tmp_path / "resumed").keys() == set(range(1, QUICK_STEPS + 1))
    worst = assert_same_adapter(adapter(tmp_path / "quick"), adapter(tmp_path / "resumed"), atol=1e-6)
    print(f"resumed adapter differs by {worst:.2e}")
