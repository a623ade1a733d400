"""Helpers every hook's checks share: the kit's batches (``kit_batch``, ``edge_batches``), the
core's log-prob/advantage/clip calls on them, and the wording of failures (rows, shapes, NaN)."""

from __future__ import annotations

import contextlib
import inspect
import math
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from rlmix import loop, ops
from rlmix.testing import standins
from rlmix.types import (
    LOSS_MODES,
    GenerationRequest,
    LossTerms,
    Minibatch,
    Normalizers,
    Prompt,
    RolloutBatch,
    Run,
)
from rlmix_conformance.kit import ConformanceFailure, Subject


def _rows(index: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``"0-3, 6"``."""
    rows = sorted(set(int(i) for i in index))
    parts, start = [], None
    for i, r in enumerate(rows):
        if start is None:
            start = r
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            parts.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def _at(index: Iterable[int]) -> str:
    """``"row 3"`` or ``"rows 0-3, 6"``."""
    rows = sorted(set(int(i) for i in index))
    return f"row {rows[0]}" if len(rows) == 1 else f"rows {_rows(rows)}"


def _shape(t: Any) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _where_raised(exc: BaseException, subject: Subject) -> str:
    """``file:line in function`` of the innermost frame in the plugin's own code."""
    module = inspect.getmodule(subject.obj) if subject.obj is not None else None
    own = getattr(module, "__file__", None)
    folder = str(Path(own).parent) if own else None
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if folder and frame.filename.startswith(folder):
            return f" (at {Path(frame.filename).name}:{frame.lineno} in {frame.name})"
    return ""


def kit_batch(run: Run, prompts: list[Prompt] | None = None, max_new_tokens: int = 6,
              n: int | None = None) -> RolloutBatch:
    """A scored batch from the fake rollout (not through the hooks), on the run's prompts."""
    if prompts is None:
        prompts = run.hook.rlmix_prompts(run=run, step=run.step)
    request = GenerationRequest(prompts=prompts, n=n or int(run.config.train.group_size),
                                temperature=1.0, max_new_tokens=max_new_tokens)
    batch = standins.FakeRollout().rlmix_generate(run=run, request=request)
    loop.score(run, batch)
    return batch


def _pad_id(run: Run) -> int:
    tok = run.tokenizer
    return int(tok.pad_token_id) if tok is not None and tok.pad_token_id is not None else 0


def _truncate_row(run: Run, batch: RolloutBatch, row: int, keep: int) -> None:
    """Keep the first ``keep`` completion tokens of ``row`` (0 = an empty completion row)."""
    cols = batch.completion_mask[row].nonzero().flatten()
    if len(cols) == 0:
        return
    start = int(cols[0]) + keep
    batch.completion_mask[row, start:] = 0
    batch.attention_mask[row, start:] = 0
    batch.tokens[row, start:] = _pad_id(run)
    batch.behavior_logp[row, start:] = 0
    kept = batch.tokens[row, int(cols[0]):start].tolist()
    if run.tokenizer is not None:
        batch.texts[row] = run.tokenizer.decode(kept, skip_special_tokens=True)
    else:
        batch.texts[row] = "".join(standins.ALPHABET[(t - 2) % len(standins.ALPHABET)]
                                   for t in kept)


def edge_batches(run: Run) -> list[tuple[str, list[int], RolloutBatch]]:
    """``(description, rows it concerns, batch)`` for each edge case, scored by the run."""
    group_size = int(run.config.train.group_size)
    out = []
    batch = kit_batch(run)
    rows = list(range(group_size))
    assert batch.rewards is not None
    for v in batch.reward_terms.values():
        v[rows] = v[rows[0]].clone()
    batch.rewards[rows] = 1.0
    out.append((f"a group of identical rewards ({_at(rows)})", rows, batch))
    batch = kit_batch(run)
    _truncate_row(run, batch, 0, 1)
    loop.score(run, batch)
    out.append(("a single-token completion (row 0)", [0], batch))
    batch = kit_batch(run)
    _truncate_row(run, batch, 1, 0)
    loop.score(run, batch)
    out.append(("an empty completion row (row 1)", [1], batch))
    return out


def _normalizers(run: Run, batch: RolloutBatch) -> Normalizers:
    return Normalizers(tokens=float(batch.completion_mask.sum().clamp(min=1)),
                       sequences=float(len(batch)),
                       norm_constant=float(run.config.train.loss_norm_constant
                                           or run.config.sampling.max_new_tokens))


def _logprobs(run: Run, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Leaf tensors ``(logp, entropy)`` from the tiny policy, for gradients w.r.t. them."""
    assert run.policy is not None
    with torch.no_grad():
        logp, entropy = run.policy.logprobs(run, batch)
    return (logp.detach().float().clone().requires_grad_(True),
            entropy.detach().float().clone().requires_grad_(True))


@contextlib.contextmanager
def _stale(run: Run, batch: RolloutBatch, seed: int = 0) -> Iterator[None]:
    """Make ``batch`` look one policy version old, with behaviour log-probs away from the
    current policy's, so ratio- and staleness-based losses take their off-policy paths."""
    g = torch.Generator().manual_seed(seed)
    noise = 0.3 * torch.randn(batch.behavior_logp.shape, generator=g)
    batch.behavior_logp = (batch.behavior_logp + noise).clamp(max=0) * batch.completion_mask
    saved = run.policy_version
    run.policy_version = int(batch.policy_version.max()) + 1
    try:
        yield
    finally:
        run.policy_version = saved


def _advantages(run: Run, batch: RolloutBatch) -> None:
    """The run's advantages; where they are unusable (rlmix_advantage's own checks report
    that), the stand-in's, so rlmix_clip is judged on valid input."""
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    ok = isinstance(adv, torch.Tensor) and tuple(adv.shape) in (
        (len(batch),), tuple(batch.tokens.shape)) and bool(torch.isfinite(adv).all())
    if not ok:
        adv = standins.SimpleAlgorithm().rlmix_advantage(run=run, batch=batch)
    batch.advantages = adv


def _clip(run: Run, batch: RolloutBatch, normalizers: Normalizers | None = None
          ) -> tuple[LossTerms, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(terms, aggregated value, logp leaf, entropy leaf)`` of the run's rlmix_clip."""
    logp, entropy = _logprobs(run, batch)
    normalizers = normalizers or _normalizers(run, batch)
    mb = Minibatch(batch=batch, normalizers=normalizers)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    _check_loss_terms(terms, batch)
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, normalizers)
    if terms.extra is not None:
        value = value + terms.extra
    return terms, value, logp, entropy


def _check_loss_terms(terms: Any, batch: RolloutBatch) -> None:
    expected = tuple(batch.tokens.shape)
    if terms is None:
        raise ConformanceFailure("rlmix_clip returned None; return LossTerms(loss=..., mask=...)")
    if not isinstance(terms, LossTerms):
        raise ConformanceFailure(f"rlmix_clip returned {type(terms).__name__}; expected "
                                 f"rlmix.LossTerms")
    for name in ("loss", "mask"):
        value = getattr(terms, name)
        if not isinstance(value, torch.Tensor):
            raise ConformanceFailure(f"rlmix_clip returned LossTerms.{name} of type "
                                     f"{type(value).__name__}; expected a tensor of shape "
                                     f"{expected} = mb.batch.tokens.shape")
        if tuple(value.shape) != expected:
            raise ConformanceFailure(f"rlmix_clip returned {name} of shape {_shape(value)}; "
                                     f"expected {expected} = mb.batch.tokens.shape")
    if not terms.loss.is_floating_point():
        raise ConformanceFailure(f"rlmix_clip returned loss of dtype {terms.loss.dtype}; "
                                 f"expected a floating-point tensor")
    if terms.mode not in LOSS_MODES:
        raise ConformanceFailure(f"rlmix_clip returned mode {terms.mode!r}; choose one of "
                                 f"{', '.join(LOSS_MODES)}")
    if terms.extra is not None and (not isinstance(terms.extra, torch.Tensor)
                                    or terms.extra.numel() != 1):
        raise ConformanceFailure(f"rlmix_clip returned LossTerms.extra of shape "
                                 f"{_shape(terms.extra)}; expected a scalar tensor (an "
                                 f"already-normalised term added after aggregation)")
    for key, value in terms.metrics.items():
        try:
            float(value)
        except (TypeError, ValueError):
            raise ConformanceFailure(f"rlmix_clip returned metric '{key}' = {value!r}, which "
                                     f"float() cannot convert; metrics must be numbers"
                                     ) from None


def _batch_problems(batch: Any, hook: str) -> list[str]:
    """Structural problems of a RolloutBatch, each a sentence that says what to fix."""
    if not isinstance(batch, RolloutBatch):
        return [f"{hook} returned {type(batch).__name__}; expected rlmix.RolloutBatch"]
    problems = []
    n, width = batch.tokens.shape
    if batch.tokens.is_floating_point():
        problems.append(f"{hook} returned tokens of dtype {batch.tokens.dtype}; expected "
                        f"integer token ids (torch.long)")
    for name in ("attention_mask", "completion_mask", "behavior_logp"):
        value = getattr(batch, name)
        if tuple(value.shape) != (n, width):
            problems.append(f"{hook} returned {name} of shape {_shape(value)}; expected "
                            f"{(n, width)} = batch.tokens.shape")
    for name in ("group", "policy_version"):
        value = getattr(batch, name)
        if tuple(value.shape) != (n,):
            problems.append(f"{hook} returned {name} of shape {_shape(value)}; expected ({n},)")
    for name in ("texts", "prompts"):
        if len(getattr(batch, name)) != n:
            problems.append(f"{hook} returned {len(getattr(batch, name))} {name} for {n} rows; "
                            f"give one per row (prompts: the Prompt each row answers)")
    if problems:
        return problems
    cmask = batch.completion_mask > 0
    outside = cmask & (batch.attention_mask == 0)
    if outside.any():
        rows = outside.any(-1).nonzero().flatten().tolist()
        problems.append(f"{hook} returned completion_mask 1 where attention_mask is 0 ("
                        f"{_at(rows)}); generated tokens are attended tokens")
    blogp = batch.behavior_logp.float()
    if not torch.isfinite(blogp[cmask]).all():
        rows = (~torch.isfinite(blogp) & cmask).any(-1).nonzero().flatten().tolist()
        problems.append(f"{hook} returned non-finite behavior_logp on completion tokens ("
                        f"{_at(rows)}); record the sampling distribution's log-prob of each "
                        f"sampled token")
    elif (blogp[cmask] > 1e-4).any():
        problems.append(f"{hook} returned behavior_logp > 0 on completion tokens (max "
                        f"{float(blogp[cmask].max()):.3g}); these are log-probabilities (<= 0)")
    off = blogp[~cmask]
    if len(off) and (~torch.isfinite(off) | (off.abs() > 1e-6)).any():
        problems.append(f"{hook} returned behavior_logp != 0 outside the completion (prompt and "
                        f"padding columns); set it to 0 where completion_mask is 0")
    return problems


def _same(a: Any, b: Any, path: str = "") -> str | None:
    """Where ``a`` and ``b`` differ (tensors compared exactly, NaN equal to NaN), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{path}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        if not torch.equal(a.cpu(), b.cpu()) and not (
                a.is_floating_point() and torch.allclose(a.cpu(), b.cpu(), equal_nan=True,
                                                         rtol=0, atol=0)):
            return f"{path}: tensor values differ"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            found = _same(a[k], b[k], f"{path}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b) or type(a) is not type(b):
            return f"{path}: {type(a).__name__} of {len(a)} vs {type(b).__name__} of {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _same(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    try:
        equal = bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==
        equal = repr(a) == repr(b)
    return None if equal else f"{path}: {a!r} vs {b!r}"


def _finite_rows(t: torch.Tensor) -> list[int]:
    bad = ~torch.isfinite(t.detach().float())
    if bad.dim() > 1:
        bad = bad.flatten(1).any(-1)
    return bad.nonzero().flatten().tolist()


def _nan_word(t: torch.Tensor) -> str:
    t = t.detach().float()
    return "NaN" if torch.isnan(t).any() else "inf"
