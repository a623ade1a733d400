"""How far each lowbit_rollout sampler copy is from the fp32 model it copies, on its own samples.

    OMP_NUM_THREADS=1 python bench/lowbit_mismatch.py [--model smollm2-135m] [--tokens 16]
    python bench/lowbit_mismatch.py --model tiny-random --tokens 4       # plumbing only

For each copy (the variants of bench/lowbit_decode.py, plus the dynamic int8 kernel with an
fp32 or bf16 LM head), sample ``--tokens`` new tokens at temperature 1 from the copy for
``--prompts`` arithmetic prompts of the demo's kind (chat template, two-digit additions), then
score those tokens under the copy and under the fp32 master. It prints the mean and max per-token
``|log p_fp32 - log p_copy|``, the fraction of greedy (argmax) next tokens on which the two
agree, and one decoded sample. These are the figures ``lowbit_rollout/logp_diff_abs_*`` log during
training, measured before any training and without the loop.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from lowbit_decode import VARIANTS as DECODE_VARIANTS  # noqa: E402  (also finds the plugin)

#: name: (precision, lm_head, int8_kernel, prepack): the decode bench's copies, and the dynamic
#: kernel with a higher-precision head (does the head or the body carry the mismatch?)
VARIANTS = {**DECODE_VARIANTS, "int8-dynamic-fp32head": ("int8", "fp32", "dynamic", False),
            "int8-dynamic-bf16head": ("int8", "bf16", "dynamic", False)}


def completion_logits(model: Any, ids: torch.Tensor, attn: torch.Tensor, start: int
                      ) -> torch.Tensor:
    """fp32 log-softmax of the logits that predict ``ids[:, start:]``."""
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    return torch.log_softmax(logits[:, start - 1:-1], -1)


def mismatch(master: Any, copy: Any, tok: Any, prompts: list[str], tokens: int, seed: int
             ) -> dict[str, Any]:
    """Sample from ``copy``; compare the per-token log-probs of its samples with ``master``'s."""
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(seed)
    with torch.no_grad():
        ids = copy.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                            temperature=1.0, top_k=0, top_p=1.0,
                            pad_token_id=tok.pad_token_id)
        start = enc.input_ids.shape[1]
        attn = torch.cat([enc.attention_mask,
                          torch.ones(len(ids), ids.shape[1] - start, dtype=torch.long)], 1)
        lp_master = completion_logits(master, ids, attn, start)
        lp_copy = completion_logits(copy, ids, attn, start)
    target = ids[:, start:, None]
    diff = (lp_master.gather(-1, target) - lp_copy.gather(-1, target)).abs()
    agree = (lp_master.argmax(-1) == lp_copy.argmax(-1)).float().mean()
    return {"mean": float(diff.mean()), "max": float(diff.max()), "argmax_agree": float(agree),
            "sample": tok.decode(ids[0, start:], skip_special_tokens=True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from rlmix_lowbit_rollout.quant import LowbitWeights

    from rlmix.policy import load_model

    master, tok = load_model(args.model, "float32")
    master.eval()
    rng = random.Random(args.seed)
    questions = [f"What is {rng.randint(10, 99)}+{rng.randint(10, 99)}?"
                 for _ in range(args.prompts)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True) for q in questions]
    print(f"model {args.model}, {args.prompts} prompts x {args.tokens} sampled tokens (T = 1), "
          f"seed {args.seed}")
    print("| sampler copy | mean abs dlogp / token | max | argmax agrees with fp32 | a sample |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.variants:
        precision, head, kernel, prepack = VARIANTS[name]
        copy = master if precision == "fp32" else LowbitWeights(  # fp32: the master, 0
            master, precision, lm_head=head, int8_kernel=kernel, prepack=prepack).model
        r = mismatch(master, copy, tok, prompts, args.tokens, args.seed)
        sample = r["sample"].replace("\n", " ").replace("|", "/")[:60]
        print(f"| {name} | {r['mean']:.3f} | {r['max']:.2f} | {r['argmax_agree']:.3f} | "
              f"`{sample}` |", flush=True)
        del copy
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
