"""Checks of ``rlmix_token_logprobs``: shapes and agreement with the model."""

from __future__ import annotations

import torch

from rlmix_conformance.batches import _shape
from rlmix_conformance.kit import ConformanceFailure, Subject, check


@check("rlmix_token_logprobs", "matches_torch", owner_only=True)
def _token_logprobs(s: Subject) -> None:
    """(logp, entropy) [n, t] equal the plain torch computation (values and gradients), with the
    sampling temperature applied, also for n = t = 1."""
    from rlmix.policy import plain_token_logprobs

    for temperature in (1.0, 0.7):
        run = s.run([f"sampling.temperature={temperature}"])
        for n, t in ((3, 7), (1, 1)):
            g = torch.Generator().manual_seed(n * 100 + t)
            hidden = torch.randn(n, t, 16, generator=g)
            head = torch.nn.Linear(16, 50, bias=False)
            with torch.no_grad():
                head.weight.copy_(torch.randn(50, 16, generator=g) * 0.5)
            labels = torch.randint(0, 50, (n, t), generator=g)
            weights = torch.randn(2, n, t, generator=g)
            results = []
            for fn in ("plugin", "torch"):
                h = hidden.clone().requires_grad_(True)
                head.zero_grad()
                if fn == "plugin":
                    out = run.hook.rlmix_token_logprobs(run=run, hidden=h, lm_head=head,
                                                        labels=labels)
                    if not isinstance(out, tuple) or len(out) != 2:
                        raise ConformanceFailure(f"rlmix_token_logprobs returned "
                                                 f"{type(out).__name__}; expected (logp, "
                                                 f"entropy)")
                else:
                    out = plain_token_logprobs(h, head, labels, temperature)
                logp, entropy = out
                for name, value in (("logp", logp), ("entropy", entropy)):
                    if tuple(value.shape) != (n, t):
                        raise ConformanceFailure(f"rlmix_token_logprobs returned {name} of "
                                                 f"shape {_shape(value)}; expected {(n, t)} = "
                                                 f"labels.shape")
                ((logp.float() * weights[0]).sum() + (entropy.float() * weights[1]).sum()
                 ).backward()
                results.append((logp.detach().float(), entropy.detach().float(),
                                h.grad.clone(), head.weight.grad.clone()))
            names = ("logp", "entropy", "the gradient w.r.t. hidden",
                     "the gradient w.r.t. lm_head.weight")
            for name, ours, ref in zip(names, results[0], results[1]):
                if not torch.allclose(ours, ref, rtol=1e-4, atol=1e-4):
                    err = float((ours - ref).abs().max())
                    raise ConformanceFailure(f"rlmix_token_logprobs: {name} differs from the "
                                             f"plain torch computation by {err:.3g} at "
                                             f"temperature {temperature} (n={n}, t={t}); divide "
                                             f"the logits by run.config.sampling.temperature")
