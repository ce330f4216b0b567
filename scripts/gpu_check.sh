#!/usr/bin/env bash
# The CUDA path checked in one call (docs/gpu.md):
#
#   scripts/gpu_check.sh RESULTS_DIR              a GPU machine, fresh and offline: .gpu/ carried with the call
#   scripts/gpu_check.sh --rehearse RESULTS_DIR   a CPU: the same steps at tiny sizes (CI runs it)
#
# Installs the bundle's wheels (make gpu-bundle) into a folder put first on PYTHONPATH with
# `pip install --no-index --no-deps --target` (a rehearsal checks the bundle against its manifest instead), then
# runs scripts/gpu_check.py: versions, the gpu-marked tests, every demo, the benchmarks; results in RESULTS_DIR
# (gpu_results.json, gpu_results.md, gpu_check.log). --installed: a machine where the packages are installed
# already (make install): no bundle. Other options go to scripts/gpu_check.py (--work, --only, --budget-s).
# Exit 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
rehearse=0 installed=0
for arg in "$@"; do
    if [ "$arg" = "--rehearse" ]; then rehearse=1; fi
    if [ "$arg" = "--installed" ]; then installed=1; fi  # your own GPU machine, packages installed: no bundle
done
site=${QLORA_GPU_SITE:-${TMPDIR:-/tmp}/qlora-gpu-site}
report="$site.json"
# nothing outside the machine can be reached: no hub look-ups, no waiting on them
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ "$installed" = 1 ]; then
    rm -f "$report"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif [ "$rehearse" = 1 ]; then
    "$PYTHON" scripts/gpu_bundle.py install --rehearse --target "$site" --report "$report"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    "$PYTHON" scripts/gpu_bundle.py install --target "$site" --report "$report"
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PYTHON" scripts/gpu_check.py --install-report "$report" "$@"
