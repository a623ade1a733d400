"""The fixed memory of training SmolLM2-135M in fp32 with AdamW, whatever the framework.

    OMP_NUM_THREADS=1 python bench/static_memory.py [--in-backward]

Loads the model, runs one forward, backward and (fused) AdamW step on a 4-token batch, and prints
the peak RSS (``VmHWM``) after ``import torch``, after loading, and after the step: weights,
gradients, both Adam moments and the runtime, with next to no activations. Compare it with a
framework's peak RSS on a real workload (``bench/vs_trl.py``): no trainer with fp32 AdamW and
gradient clipping can go below it. ``--in-backward`` steps each parameter inside the backward
and frees its gradient (``train.optimizer_in_backward``, no clipping): the floor without the
gradient copy.
"""

from __future__ import annotations

import argparse

import torch


def peak_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in-backward", action="store_true",
                    help="step each parameter inside the backward (no clipping)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"after import torch: {peak_mib():.0f} MiB")
    from rlmix.defaults import adamw
    from rlmix.policy import load_model

    model, _ = load_model("smollm2-135m")
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    print(f"after loading: {peak_mib():.0f} MiB ({n / 1e6:.1f}M parameters, "
          f"{n * 4 / 2**20:.0f} MiB of fp32 weights)")
    optimizer = adamw(params, lr=1e-6)
    tokens = torch.randint(0, 1000, (1, 4))
    loss = model(input_ids=tokens).logits.float().logsumexp(-1).mean()
    if args.in_backward:
        from rlmix.defaults import StepInBackward

        StepInBackward(optimizer, params).backward(loss, 1e-6)
        what = "weights + Adam moments + one parameter's gradient at a time + runtime"
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        what = "weights + gradients + Adam moments + runtime"
    print(f"after one training step ({what}): {peak_mib():.0f} MiB")


if __name__ == "__main__":
    main()
