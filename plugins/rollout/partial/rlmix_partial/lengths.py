"""A length-controlled model for tests and benchmarks: heavy-tailed response lengths from a
forward hook that sets the probability of the stop token by position.

At completion position ``t`` (``t = position - start``) the stop token gets probability
``h(t) = alpha / (t + scale)`` under the sampling temperature, so a response survives past
``t`` tokens with probability about ``(scale / (t + scale)) ** alpha``: a Pareto tail with
index ``alpha``. The hook sees the ``position_ids`` every forward receives (the ``hf`` engine's
and ``partial``'s decoding loops pass them), so it needs no state and works on a copy of the
model (``frozen_copy`` copies hooks). ``Policy.logprobs`` runs the base model and the LM head
itself, so the trainer does not see the forced stop probabilities (fine for throughput).
"""

from __future__ import annotations

from typing import Any

import torch


def heavy_tail_eos(model: Any, eos_id: int, start: int, alpha: float = 1.0,
                   scale: float = 2.0, temperature: float = 1.0) -> Any:
    """Register the hook on ``model`` (a causal LM returning ``logits``); returns its handle."""
    if alpha <= 0 or scale <= 0 or temperature <= 0:
        raise ValueError("alpha, scale and temperature must be > 0")

    def hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        pos = kwargs.get("position_ids")
        logits = getattr(output, "logits", None)
        if pos is None or logits is None or logits.shape[1] != pos.shape[1]:
            return output
        t = (pos.to(logits.device) - start).to(torch.float32)
        h = (alpha / (t.clamp(min=0) + scale)).clamp(max=0.999)
        others = logits.float().clone()
        others[..., eos_id] = float("-inf")
        lse = torch.logsumexp(others / temperature, -1)
        forced = temperature * (lse + torch.log(h) - torch.log1p(-h))
        new = logits.clone()
        new[..., eos_id] = torch.where(t >= 0, forced, logits[..., eos_id].float()).to(
            logits.dtype)
        output["logits"] = new
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


def survival(t: float, alpha: float = 1.0, scale: float = 2.0) -> float:
    """Probability that a response is longer than ``t`` tokens under the hook (exact)."""
    p = 1.0
    for j in range(int(t)):
        p *= 1.0 - min(alpha / (j + scale), 0.999)
    return p if t >= 0 else 1.0


__all__ = ["heavy_tail_eos", "survival"]
