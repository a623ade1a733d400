"""How far each lowbit_rollout sampler copy is from the fp32 model it copies, on its own samples.

    OMP_NUM_THREADS=1 python bench/lowbit_mismatch.py [--model smollm2-135m] [--tokens 16]
    python bench/lowbit_mismatch.py --model tiny-random --tokens 4       # plumbing only

For each copy (the variants of bench/lowbit_decode.py, plus the dynamic int8 kernel with an
fp32 or bf16 LM head), sample ``--tokens`` new tokens at temperature 1 from the copy for
``--prompts`` arithmetic prompts of the demo's kind (chat template, two-digit additions) with the
engine's own decode loop (``rlmix.sampling.sample_tokens``: one prefill, then one position per
row per step), which returns the behaviour log-probs of the sampled tokens, and score those tokens
under the fp32 master. It prints the mean and max per-token ``|log p_fp32 - log p_behaviour|``
(what ``lowbit_rollout/logp_diff_abs_*`` log during training, measured before any training and
without the loop), the same for the copy re-scoring the whole sequence in one forward (a
prefill-shaped call, which a w8a8 copy quantises per token), the fraction of greedy (argmax) next
tokens on which that re-scoring and fp32 agree, and one decoded sample.
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
from lowbit_decode import w8a8_gemm  # noqa: E402

#: name: (precision, lm_head, int8_kernel, prepack): the decode bench's copies, and the dynamic
#: kernel with a higher-precision head (does the head or the body carry the mismatch?)
VARIANTS = {**DECODE_VARIANTS, "int8-dynamic-fp32head": ("int8", "fp32", "dynamic", False),
            "int8-dynamic-bf16head": ("int8", "bf16", "dynamic", False)}


def completion_logits(model: Any, ids: torch.Tensor, attn: torch.Tensor, start: int
                      ) -> torch.Tensor:
    """fp32 log-softmax of the logits that predict ``ids[:, start:]`` (positions from the
    mask, as the decode loop counts them under left padding)."""
    positions = (attn.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits.float()
    return torch.log_softmax(logits[:, start - 1:-1], -1)


def mismatch(master: Any, copy: Any, tok: Any, prompts: list[str], tokens: int, seed: int
             ) -> dict[str, Any]:
    """Sample from ``copy`` with the engine's decode loop; compare the behaviour log-probs of
    its samples, and the copy's re-scoring of them, with ``master``'s."""
    from rlmix.sampling import sample_tokens

    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        completion, _, behaviour = sample_tokens(
            copy, enc.input_ids, enc.attention_mask, 1, tokens, 1.0, 1.0, 0, [-1],
            tok.pad_token_id, generator=gen)  # no stop token: every row has ``tokens``
        start = enc.input_ids.shape[1]
        ids = torch.cat([enc.input_ids, completion], 1)
        attn = torch.cat([enc.attention_mask, torch.ones_like(completion)], 1)
        lp_master = completion_logits(master, ids, attn, start)
        lp_copy = completion_logits(copy, ids, attn, start)
    target = completion[..., None]
    master_lp = lp_master.gather(-1, target)[..., 0]
    diff = (master_lp - behaviour.float()).abs()
    rescored = (master_lp - lp_copy.gather(-1, target)[..., 0]).abs()
    agree = (lp_master.argmax(-1) == lp_copy.argmax(-1)).float().mean()
    return {"mean": float(diff.mean()), "max": float(diff.max()),
            "rescored_mean": float(rescored.mean()), "argmax_agree": float(agree),
            "sample": tok.decode(completion[0], skip_special_tokens=True)}


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
    print("| sampler copy | mean abs dlogp / token (behaviour) | max | mean abs dlogp / token "
          "(re-scored) | argmax agrees with fp32 | a sample |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.variants:
        precision, head, kernel, prepack = VARIANTS[name]
        attention = "eager" if name.endswith("-eager") else "model"
        copy = master if precision == "fp32" else LowbitWeights(  # fp32: the master, 0
            master, precision, lm_head=head, int8_kernel=kernel, prepack=prepack,
            attention=attention,
            w8a8_decode="token" if name.endswith("-token") else "auto",
            w8a8_gemm=w8a8_gemm(name)).model
        r = mismatch(master, copy, tok, prompts, args.tokens, args.seed)
        sample = r["sample"].replace("\n", " ").replace("|", "/")[:60]
        print(f"| {name} | {r['mean']:.3f} | {r['max']:.2f} | {r['rescored_mean']:.3f} | "
              f"{r['argmax_agree']:.3f} | `{sample}` |", flush=True)
        del copy
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
