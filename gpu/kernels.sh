#!/usr/bin/env bash
# GPU check of the fused_logprobs kernels (plugin plugins/kernels/fused_logprobs), in one call:
#   bash gpu/kernels.sh                 # correctness, then a timing table (a few minutes)
#   bash gpu/kernels.sh --dry-run       # the plan only; runs without a GPU
#   bash gpu/kernels.sh --tokens 16384 --dtypes bf16 --sweep
# Extra arguments go to gpu/kernels_fused_logprobs.py (see --help). Liger-Kernel is compared
# when it imports; the GPU machine has no network, so to include it put its wheel in
# gpu/wheels/ first (pip download --no-deps liger-kernel -d gpu/wheels) and it is installed
# from there. Output: one JSON line per check and timing, then a Markdown table; the whole
# log is also written to $OUT/kernels.log when $OUT is set (the device tool's output folder).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import liger_kernel" 2>/dev/null && compgen -G "gpu/wheels/liger_kernel-*.whl" >/dev/null; then
  "$PY" -m pip install --no-deps --no-index -q gpu/wheels/liger_kernel-*.whl || true
fi
if [ -n "${OUT:-}" ]; then
  "$PY" gpu/kernels_fused_logprobs.py "$@" 2>&1 | tee "$OUT/kernels.log"
else
  "$PY" gpu/kernels_fused_logprobs.py "$@"
fi
