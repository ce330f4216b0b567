#!/usr/bin/env bash
# LLaMA-Factory and axolotl, each in its own virtual environment under .cache/peers/, for `make bench-peers`
# (benchmarks/bench_peers.py); never in CI. Idempotent: an environment whose marker file is there is kept.
#   LLaMA-Factory 0.9.5 (Python 3.11): it requires torchvision and torchaudio, which it never imports for text;
#     torch is the CPU build where one lies on this machine, torchaudio is installed without its dependencies, and
#     torchvision (only CUDA builds on the registry) is removed after the install.
#   axolotl 0.21 (Python >= 3.12, PYENV_VERSION=3.12.1 where pyenv manages the interpreters).
set -euo pipefail
PEERS=${PEERS:-.cache/peers}
mkdir -p "$PEERS"

if [ ! -f "$PEERS/llamafactory/.installed" ]; then
  PY311=${PY311:-python3.11}
  $PY311 -c "" 2>/dev/null || PY311="env PYENV_VERSION=3.11.7 python"
  $PY311 -m venv "$PEERS/llamafactory"
  LF="$PEERS/llamafactory/bin/python"
  $LF -m pip install -q --no-warn-script-location --upgrade pip
  cpu_torch=$(ls /opt/wheels/torch-*+cpu-cp311-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$cpu_torch" ]; then $LF -m pip install -q --no-warn-script-location "$cpu_torch"; fi
  $LF -m pip install -q --no-warn-script-location --no-deps "torchaudio<2.14" "torchvision<0.29"
  $LF -m pip install -q --no-warn-script-location "llamafactory==0.9.5"
  # transformers imports torchvision where it is installed, and this CUDA build fails against the CPU torch: off
  $LF -m pip uninstall -q -y torchvision
  # ... and torchaudio's compiled parts (a CUDA build too): without them it imports, and text never calls it
  rm -f "$PEERS"/llamafactory/lib/python3*/site-packages/torchaudio/lib/*.so
  touch "$PEERS/llamafactory/.installed"
fi

if [ ! -f "$PEERS/axolotl/.installed" ]; then
  PY312=${PY312:-python3.12}
  $PY312 -c "" 2>/dev/null || PY312="env PYENV_VERSION=3.12.1 python"
  $PY312 -m venv "$PEERS/axolotl"
  AX="$PEERS/axolotl/bin/python"
  $AX -m pip install -q --no-warn-script-location --upgrade pip
  $AX -m pip install -q --no-warn-script-location "axolotl==0.21.0"
  touch "$PEERS/axolotl/.installed"
fi
echo "peers installed in $PEERS"
