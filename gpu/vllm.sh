#!/usr/bin/env bash
# GPU check of the vLLM rollout plugin (plugins/rollout/vllm), in one call on a lent GPU machine:
#   bash gpu/vllm.sh
# 1. vLLM is imported, or installed from gpu/wheels/ when its wheels were put there (the GPU
#    machine has no network; never from an index); without vLLM the script says so and stops
#    (exit 0, nothing checked).
# 2. gpu/vllm_check.py, one part per process (a few minutes in all, on a SmolLM2-135M-shaped
#    random Llama):
#    sync:       vLLM behaviour log-probs vs the trainer's (fp32), then after a weight push
#    sleep:      GPU memory held awake vs asleep (sleep_level 1); generate wakes and re-sleeps
#    throughput: generated tokens/s, vLLM vs rollout/hf, same requests
# Output: JSON lines and a Markdown table; a copy in $OUT/vllm.log when $OUT is set. Record the
# table in BENCHMARKS.md with this command. Exit status 1 if a check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="core:plugins/rollout/hf:plugins/rollout/vllm${PYTHONPATH:+:$PYTHONPATH}"
LOG=${OUT:-/tmp}/vllm.log
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }

# never install vLLM (it pins a CUDA torch) into an environment without a GPU
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  say '{"check": "vllm", "skipped": "no CUDA GPU"}'
  exit 0
fi
# only from wheels put in gpu/wheels/ beforehand: never from an index (a half-finished vLLM
# install replaces torch with another build and leaves the environment broken)
if ! "$PY" -c "import vllm" 2>/dev/null && compgen -G "gpu/wheels/vllm-*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --find-links gpu/wheels vllm 2>&1 | tail -3
fi
if ! "$PY" -c "import vllm" 2>/dev/null; then
  say '{"check": "vllm", "skipped": "vllm is not importable here and gpu/wheels/ holds no vllm wheel"}'
  exit 0
fi

FOLDER=$(mktemp -d /tmp/rlmix-vllm-model-XXXX)
status=0
say ""
say "| check | result | verdict |"
say "| --- | --- | --- |"
for part in sync sleep throughput; do
  timeout 240 "$PY" gpu/vllm_check.py --part "$part" --folder "$FOLDER" "$@" 2>>"$LOG.stderr" \
    | tee -a "$LOG" || status=1
done
say ""
say "vllm check: $([ $status -eq 0 ] && echo ok || echo FAILED) (stderr in $LOG.stderr)"
[ $status -ne 0 ] && tail -40 "$LOG.stderr"
exit $status
