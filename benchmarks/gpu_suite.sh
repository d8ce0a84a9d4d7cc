#!/usr/bin/env bash
# The GPU suite on a lent GPU machine: benchmarks/gpu_suite.py with this checkout on PYTHONPATH, the
# JSON (and nvidia-smi's view) written to $OUT (the device tool's result folder) or the current folder.
#   bash benchmarks/gpu_suite.sh                    # every part, <= 6 minutes on one H100
#   bash benchmarks/gpu_suite.sh --parts fp8        # a rerun of some parts
set -u
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PTDP_CACHE_DIR="${PTDP_CACHE_DIR:-/tmp/ptdp-cache}"   # the default corpus, built once per machine
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
python -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    > "$out/versions.txt" 2>&1 || true
# the suite caps itself at 350 s; this ceiling only catches a hang of the suite itself
timeout 400 python benchmarks/gpu_suite.py --out "$out/gpu_suite.json" "$@"
