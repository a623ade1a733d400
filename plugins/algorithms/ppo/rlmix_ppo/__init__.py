"""PPO for language models: a learned critic (a copy of the policy's trunk with a value head),
GAE advantages over the completion tokens, the clipped surrogate and a clipped value loss."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix import ops
from rlmix.policy import shared_prefix_hidden
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, RolloutBatch, Run

NAME = "ppo"
OLD_LOGP = ops.OLD_LOGP_CHOICES
VALUES = "ppo.values"  # batch.extras key: the critic's values at advantage time, [N, T]
RETURNS = "ppo.returns"  # batch.extras key: the GAE returns (value targets), [N, T]
# in run.plugin_resources("ppo"): the critic, its optimizer, the state dict last synced
_CRITIC, _OPTIMIZER, _SYNCED = "critic", "optimizer", "synced"
# shared with the other PPO-style losses, kept in rlmix.ops
clipped_surrogate = ops.clipped_surrogate
whiten = ops.masked_whiten


@dataclass
class Settings:
    gamma: float = rlmix.setting(1.0, ge=0, le=1)  # discount per completion token
    # GAE lambda; 1 = Monte-Carlo return minus the value
    lam: float = rlmix.setting(0.95, ge=0, le=1)
    whiten: bool = True  # normalise advantages to mean 0, std 1 over the batch's tokens
    eps_low: float = rlmix.setting(0.2, ge=0, lt=1)  # ratio clipped below at 1 - eps_low
    eps_high: float = rlmix.setting(0.2, ge=0)  # ratio clipped above at 1 + eps_high
    loss_mode: str = "token-mean"  # aggregation of the policy loss
    old_logp: str = "auto"  # what the ratio divides by (as in grpo)
    vf_coef: float = rlmix.setting(0.1, ge=0)  # weight of the value loss in the summed loss
    # new values kept within old +- value_clip; 0 = no value clipping
    value_clip: float = rlmix.setting(0.2, ge=0)
    critic_lr: float = rlmix.setting(1e-5, gt=0)
    critic_weight_decay: float = rlmix.setting(0.0, ge=0)
    critic_max_grad_norm: float = rlmix.setting(1.0, ge=0)  # 0 = no clipping

    def __post_init__(self) -> None:
        rlmix.check_choices(self, loss_mode=LOSS_MODES, old_logp=OLD_LOGP)
        rlmix.check_ranges(self)


# ---------------------------------------------------------------- pure tensor math


def outcome_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards ``[N, T]``: each row's scalar reward on its last masked-in column,
    zero elsewhere (and zero everywhere in a row with no masked-in column)."""
    on = mask > 0
    width = mask.shape[-1]
    last = (torch.arange(width, device=mask.device) * on).argmax(-1)
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    has_any = on.any(-1)
    out[torch.arange(len(rewards), device=mask.device)[has_any], last[has_any]] = rewards[has_any]
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the masked-in tokens of each row.

    With ``delta_t = r_t + gamma * V_next - V_t`` (``V_next`` = the value of the row's next
    masked-in token, 0 after its last), ``A_t = delta_t + gamma * lam * A_next``. Masked-out
    columns (padding, prompt, tool output) are skipped as if absent: their values and rewards are
    ignored and they carry no discount. Returns ``(advantages, returns)``, ``returns = A + V``,
    both zero off the mask."""
    on = mask > 0
    n, width = values.shape
    advantages = torch.zeros_like(values)
    cols = on.any(0).nonzero().flatten()
    if len(cols) == 0:
        return advantages, torch.zeros_like(values)
    next_value = values.new_zeros(n)
    running = values.new_zeros(n)
    for t in range(int(cols[-1]), int(cols[0]) - 1, -1):
        here = on[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(here, delta + gamma * lam * running, running)
        next_value = torch.where(here, values[:, t], next_value)
        advantages[:, t] = torch.where(here, running, torch.zeros_like(running))
    returns = torch.where(on, advantages + values, torch.zeros_like(values))
    return advantages, returns


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``; ``clip == 0``
    gives the plain ``0.5 * (V - R)^2``. Also returns where the clipped term was the larger."""
    unclipped = (values - returns) ** 2
    if clip <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    kept = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (kept - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the mask: 1 for a perfect critic, 0 for one no better
    than the mean return; 0.0 when the returns do not vary (nothing to explain)."""
    mask = mask.to(returns.dtype)
    var_returns = float(ops.masked_var(returns, mask))
    if var_returns <= 1e-12:
        return 0.0
    return 1.0 - float(ops.masked_var(returns - values, mask)) / var_returns


# ---------------------------------------------------------------- the critic


class ValueModel(torch.nn.Module):
    """A transformer trunk and a linear value head (hidden -> 1, zero-initialised). Values are
    aligned with ``tokens`` like log-probs: column ``t`` is ``V`` of the state before token ``t``
    (the head applied to the hidden state at position ``t - 1``); zero before the first
    completion column."""

    def __init__(self, trunk: torch.nn.Module) -> None:
        super().__init__()
        self.trunk = trunk
        config = trunk.config
        hidden = getattr(config, "hidden_size", None)
        if hidden is None:
            hidden = config.get_text_config().hidden_size
        device = next(trunk.parameters()).device
        self.head = torch.nn.Linear(int(hidden), 1, device=device, dtype=torch.float32)
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.zero_()

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor,
                completion_mask: torch.Tensor, share_prefix: bool = True,
                autocast: contextlib.AbstractContextManager | None = None) -> torch.Tensor:
        device = self.head.weight.device
        tokens, attn = tokens.to(device), attention_mask.to(device)
        n, width = tokens.shape
        cols = completion_mask.sum(0).nonzero()
        if len(cols) == 0:
            return torch.zeros(n, width, device=device)
        first = max(int(cols[0]), 1)
        position_ids = (attn.long().cumsum(-1) - 1).clamp(min=0)
        with autocast if autocast is not None else contextlib.nullcontext():
            if share_prefix:
                hidden = shared_prefix_hidden(self.trunk, tokens, attn, position_ids, first)
            else:
                hidden = self.trunk(input_ids=tokens[:, :-1], attention_mask=attn[:, :-1],
                                    position_ids=position_ids[:, :-1],
                                    use_cache=False).last_hidden_state[:, first - 1:]
        with torch.autocast(device.type, enabled=False):
            values = torch.nn.functional.linear(hidden.float(), self.head.weight,
                                                self.head.bias).squeeze(-1)
        return torch.cat([torch.zeros(n, first, device=device), values], 1)


def build_critic(policy_model: Any) -> ValueModel:
    """A deep copy of the policy's trunk (``policy_model.base_model``) under a zero value head."""
    trunk = copy.deepcopy(policy_model.base_model)
    for p in trunk.parameters():
        p.requires_grad_(True)
    return ValueModel(trunk).train()


def _sync_state(run: Run) -> None:
    """Point ``run.plugin_state("ppo")`` (checkpointed by the core) at the live critic's state
    dicts."""
    res = run.plugin_resources(NAME)
    model, opt = res[_CRITIC], res[_OPTIMIZER]
    state = run.plugin_state(NAME)
    state.update(critic=model.state_dict(), optimizer=opt.state_dict())
    res[_SYNCED] = state


def critic(run: Run) -> tuple[ValueModel, torch.optim.Optimizer]:
    """The run's critic and its optimizer. If ``run.plugin_state("ppo")`` is not the state this
    plugin last wrote (a checkpoint was restored since), its saved weights and optimizer state
    are loaded into the live critic first."""
    res = run.plugin_resources(NAME)
    model, opt = res.get(_CRITIC), res.get(_OPTIMIZER)
    if model is None or opt is None:
        raise RuntimeError("ppo: no critic; rlmix_configure has not run with a loaded policy")
    saved = run.plugin_state(NAME)
    if saved is not res.get(_SYNCED):
        if "critic" in saved:
            model.load_state_dict(saved["critic"])
            if "optimizer" in saved:
                opt.load_state_dict(saved["optimizer"])
            s = run.settings(NAME)
            for group in opt.param_groups:  # the manifest's settings win over the saved ones
                group["lr"], group["weight_decay"] = s.critic_lr, s.critic_weight_decay
        _sync_state(run)
    return model, opt


def _values(run: Run, model: ValueModel, batch: RolloutBatch) -> torch.Tensor:
    policy = run.policy
    assert policy is not None
    share = policy.share_prefix and not policy.gradient_checkpointing
    return model(batch.tokens, batch.attention_mask, batch.completion_mask, share_prefix=share,
                 autocast=policy.autocast())


# ---------------------------------------------------------------- hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    if run.policy is None:
        return
    res = run.plugin_resources(NAME)
    if _CRITIC not in res:
        model = build_critic(run.policy.model)
        train = run.config.train
        res[_CRITIC] = model
        res[_OPTIMIZER] = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=s.critic_lr,
            betas=(float(train.adam_beta1), float(train.adam_beta2)),
            weight_decay=s.critic_weight_decay)
    critic(run)  # loads saved critic state if a checkpoint was restored before configure


@rlmix.hookimpl
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor:
    s = run.settings(NAME)
    if batch.rewards is None:
        raise RuntimeError("ppo: the batch has no rewards (rlmix_score has not run)")
    model, _ = critic(run)
    mask = batch.completion_mask.float()
    model.eval()
    try:
        with torch.no_grad():
            values = _values(run, model, batch).float().to(mask.device)
    finally:
        model.train()
    values = torch.where(mask > 0, values, torch.zeros_like(values))
    token_rewards = outcome_rewards(batch.rewards.float().to(mask.device), mask)
    advantages, returns = gae(token_rewards, values, mask, s.gamma, s.lam)
    batch.extras[VALUES] = values
    batch.extras[RETURNS] = returns
    for name, value in {  # written with the step's metrics (no dict parked in run.resources)
        "critic/explained_variance": explained_variance(values, returns, mask),
        "critic/value_mean": float(ops.masked_mean(values, mask)),
        "critic/return_mean": float(ops.masked_mean(returns, mask)),
        "ppo/advantage_std": float(ops.masked_var(advantages, mask).sqrt()),
    }.items():
        run.log(name, value)
    return whiten(advantages, mask) if s.whiten else advantages


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    if VALUES not in batch.extras or RETURNS not in batch.extras:
        raise RuntimeError("ppo: the minibatch has no value targets (batch.extras['ppo.returns']);"
                           " ppo's rlmix_clip needs ppo's rlmix_advantage, so no plugin listed "
                           "after ppo may own rlmix_advantage")
    device = logp.device
    mask = batch.completion_mask.to(device)
    behavior = batch.behavior_logp.to(device)
    old = ops.old_logprobs(run, batch, logp, s.old_logp)
    loss, clipped = clipped_surrogate(logp, old, batch.token_advantages().to(device),
                                      s.eps_low, s.eps_high)

    model, _ = critic(run)
    model.train()
    new_values = _values(run, model, batch).to(device)
    vf, vf_clipped = clipped_value_loss(new_values, batch.extras[VALUES].to(device),
                                        batch.extras[RETURNS].to(device), s.value_clip)
    vf_loss = ops.aggregate_loss(vf, mask, "token-mean", mb.normalizers)
    metrics = {
        "clip/fraction": float(ops.masked_mean(clipped.float(), mask)),
        "entropy": float(ops.masked_mean(entropy.detach(), mask)),
        "mismatch/behavior_kl": float(ops.masked_mean(behavior - logp.detach(), mask)),
        "critic/value_loss": float(ops.masked_mean(vf.detach(), mask)),
        "critic/vf_clip_fraction": float(ops.masked_mean(vf_clipped.float(), mask)),
    }
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics=metrics,
                     extra=s.vf_coef * vf_loss)


@rlmix.hookimpl(wrapper=True)
def rlmix_update(run: Run, loss: LossTerms):  # noqa: ANN201 - a pluggy wrapper (generator)
    stats = yield
    mb = loss.minibatch
    if mb is not None and not mb.last:
        return stats
    s = run.settings(NAME)
    model, opt = critic(run)
    out = dict(stats or {})
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = s.critic_max_grad_norm if s.critic_max_grad_norm > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
    # a skipped policy step (non-finite loss or gradient) skips the critic's step too
    skipped = float(out.get("update/skipped", 0.0)) > 0 or not bool(torch.isfinite(grad_norm))
    if not skipped:
        for group in opt.param_groups:
            group["lr"] = s.critic_lr
        opt.step()
    opt.zero_grad(set_to_none=True)
    _sync_state(run)
    out["critic/grad_norm"] = float(grad_norm)
    out["critic/skipped"] = float(skipped)
    return out


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    # runs before the core's checkpointer (trylast), so the checkpoint holds the current critic
    if _CRITIC in run.plugin_resources(NAME):
        critic(run)
        _sync_state(run)
