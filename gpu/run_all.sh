#!/usr/bin/env bash
# Every GPU-side check and timing of the project, in one call on a lent GPU machine:
#   bash gpu/run_all.sh
# 1. gpu/kernels.sh: fused_logprobs Triton kernels vs plain torch (and Liger when carried):
#    correctness, then a timing table at Qwen-sized shapes (hidden 4096, V 151,936).
# 2. gpu/check_core.py: the core on CUDA (sampler vs trainer log-probs, shared-prefix gradients,
#    a demo-sized GRPO step time); it reports and skips what the GPU image cannot import.
# 3. gpu/speculative.sh: speculative rollout on CUDA (lossless and greedy checks, then decode
#    tokens/s plain vs each drafter, and GRPO step time with and without speculation).
# 4. gpu/vllm.sh: vLLM rollout log-probs vs the trainer's, weight sync, sleep/wake, throughput vs
#    rollout/hf (skips with a reason when vLLM is not importable and no wheels were carried).
# Output: JSON lines and tables on stdout; copies in $OUT when the device tool sets it.
# Record the tables in BENCHMARKS.md with this command.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="core:plugins/rollout/hf:plugins/envs/arith:plugins/algorithms/grpo:plugins/kernels/fused_logprobs${PYTHONPATH:+:$PYTHONPATH}"
status=0
bash gpu/kernels.sh "$@" || status=1
if [ -n "${OUT:-}" ]; then
  "$PY" gpu/check_core.py 2>&1 | tee "$OUT/check_core.log" || status=1
else
  "$PY" gpu/check_core.py || status=1
fi
bash gpu/speculative.sh || status=1
bash gpu/vllm.sh || status=1
exit $status
