"""OSW-FT (Online Self-Weighted Fine-Tuning): SFT on each query's expert trajectory, the loss of
each query rescaled by a weight from the model's current success rate on it, estimated from
``train.group_size`` (k, 2 by default in the paper) inference-only rollouts that are scored and
never trained on.

A wrapper on ``rlmix_sample``: the owner samples the k rollouts, the wrapper scores them
(``p_hat`` per query = the share with reward >= ``success_threshold``) and returns, in their
place, one row per query: the rollouts' prompt tokens followed by the expert completion, with
its weight in ``batch.extras["osw_ft.weight"]``. ``rlmix_clip`` (owner) is the weighted token
NLL. The expert completion is ``Prompt.info["expert_ids"]`` (token ids) when the env gives it,
else ``Prompt.info["expert"]`` (text) or ``str(Prompt.answer)``, tokenised with the policy's
tokenizer and closed by the token the engine ended its rollouts with
(``rlmix.distill.stop_token``: a chat model's end-of-turn, not always the EOS)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

import rlmix
from rlmix import distill, ops, sampling
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, Prompt, RolloutBatch, Run

NAME = "osw_ft"
WEIGHT = "osw_ft.weight"
RLMIX_NOT_NEEDED = ("rlmix_advantage",)
WEIGHTING = ("one_minus_p", "uniform")


@dataclass
class Settings:
    weighting: str = "one_minus_p"  # one_minus_p (OSW-FT) | uniform (plain SFT, w = 1)
    normalize: bool = True  # weights divided by their mean over the step's queries
    success_threshold: float = 1.0  # a rollout with reward >= this succeeded
    loss_mode: str = "seq-mean-token-mean"

    def __post_init__(self) -> None:
        rlmix.check_choices(self, weighting=WEIGHTING, loss_mode=LOSS_MODES)


def query_weights(p_hat: torch.Tensor, weighting: str, normalize: bool) -> torch.Tensor:
    """``1 - p_hat`` per query (``uniform``: 1), divided by its mean over the queries when
    ``normalize`` (all ones when every query is solved, so the step keeps SFT's scale)."""
    if weighting == "uniform":
        return torch.ones_like(p_hat)
    w = 1.0 - p_hat
    if normalize:
        mean = w.mean()
        return w / mean if float(mean) > 0 else torch.ones_like(w)
    return w


def expert_ids(run: Run, prompt: Prompt, end: int | None = None) -> list[int]:
    """The expert completion's token ids, closed by ``end`` (the engine's stop token)."""
    ids = prompt.info.get("expert_ids")
    if ids is not None:
        return [int(i) for i in ids]
    tok = run.tokenizer
    if tok is None:
        raise RuntimeError("osw_ft: the prompt has no info['expert_ids'] and the run has no "
                           "tokenizer to encode its expert text")
    text = str(prompt.info.get("expert", prompt.answer))
    out = list(tok(text, add_special_tokens=False)["input_ids"])
    return out + ([end] if end is not None else [])


def expert_batch(run: Run, rollouts: RolloutBatch, weights: torch.Tensor) -> RolloutBatch:
    """One row per group of ``rollouts``: its prompt columns, then the expert completion
    (``rlmix.distill.forced_completions``), ``weights[g]`` in ``extras[WEIGHT]``."""
    groups = rollouts.group.tolist()
    rows = [groups.index(g) for g in range(rollouts.num_groups)]
    end = distill.stop_token(run, rollouts)
    batch = distill.forced_completions(run, rollouts, rows,
                                       [expert_ids(run, rollouts.prompts[r], end) for r in rows])
    batch.extras[WEIGHT] = weights.float()
    return batch


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]
                 ) -> Generator[None, RolloutBatch | None, RolloutBatch | None]:
    rollouts = yield
    if rollouts is None:
        return None
    s = run.settings(NAME)
    success = (sampling.score(run, rollouts) >= s.success_threshold).float()
    wins, counts = sampling.group_outcomes(success, rollouts.group)
    p_hat = wins / counts.clamp(min=1)
    state = run.state.setdefault(NAME, {})
    state["rollouts"] = state.get("rollouts", 0) + len(rollouts)
    run.log(f"{NAME}/p_hat", float(p_hat.mean()))
    return expert_batch(run, rollouts, query_weights(p_hat, s.weighting, s.normalize))


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    mask = batch.completion_mask.to(logp.device)
    # the wrapper in this module always sets the weights; a batch built elsewhere (a test
    # kit) without them is plain SFT on its completions
    weight = batch.extras.get(WEIGHT, torch.ones(len(batch)))
    loss = -logp * weight.to(logp.device)[:, None]
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics={
        f"{NAME}/nll": float(ops.masked_mean(-logp.detach(), mask))})
