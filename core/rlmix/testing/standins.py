"""Stand-in plugins of the conformance kit: a fake env, a fake rollout and a simple algorithm.

A plugin under test rarely works alone: a clip wrapper needs an owner of ``rlmix_clip``, a
sampling schedule needs ``rlmix_generate``, a scorer needs prompts and completions. The kit
registers these stand-ins *before* the plugin under test, so the plugin owns (or wraps) every
hook it implements and the stand-ins fill in the rest. They are small, deterministic under
``train.seed`` and the step, and usable on their own in a plugin's tests:

    run = make_run({"kit_env": FakeEnv, "kit_rollout": FakeRollout, "kit_algo": SimpleAlgorithm,
                    "mine": my_module}, with_policy=True)
"""

from __future__ import annotations

import random
from typing import Any

import torch

from rlmix import ops
from rlmix.hookspecs import hookimpl
from rlmix.types import GenerationRequest, LossTerms, Minibatch, Prompt, RolloutBatch, Run

ENV = "kit_env"
ROLLOUT = "kit_rollout"
ALGO = "kit_algo"
POISON = "kit_poison"

#: characters the fake rollout writes (digits and a few letters, so texts stay readable)
ALPHABET = "0123456789 abcdefgh"
_WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "piano", "lemon")


class FakeEnv:
    """Prompts "Spell the word W" (answer: the word's length); reward term ``even``: the fraction
    of even token ids in a completion (varied within a group, deterministic, 0 when empty)."""

    # registered beside an env under test on purpose: not a second env (rlmix.preflight)
    RLMIX_STANDIN = True

    @hookimpl
    def rlmix_prompts(self, run: Run, step: int) -> list[Prompt]:
        rng = random.Random(f"{ENV}-{int(run.config.train.seed)}-{step}")
        instructions = run.harness.get("instructions", "Answer briefly.")
        prompts = []
        for i in range(int(run.config.train.prompts_per_step)):
            word = rng.choice(_WORDS)
            messages = []
            if run.harness.get("system"):
                messages.append({"role": "system", "content": run.harness["system"]})
            messages.append({"role": "user", "content": f"Spell the word {word}. {instructions}"})
            prompts.append(Prompt(messages=messages, answer=len(word), id=f"{ENV}-{step}-{i}"))
        return prompts

    @hookimpl
    def rlmix_score(self, run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        even = ((batch.tokens % 2) == 0).float()
        return {"even": ops.masked_mean(even, batch.completion_mask.float(), dim=-1)}


def _prompt_tokens(run: Run, prompts: list[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask (the policy's chat template when there is a
    policy, else a few ids per prompt derived from its text)."""
    if run.policy is not None:
        tok = run.policy.tokenizer
        texts = [run.policy.chat_text(p.messages) for p in prompts]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc["input_ids"], enc["attention_mask"]
    rows = [[ord(c) % 32 for c in " ".join(m["content"] for m in p.messages)][:6]
            for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            attn[i, width - len(r):] = 1
    return ids, attn


def _alphabet_ids(run: Run) -> list[int]:
    if run.policy is None:
        return list(range(2, 2 + len(ALPHABET)))
    tok = run.policy.tokenizer
    ids = []
    for ch in ALPHABET:
        enc = tok(ch, add_special_tokens=False)["input_ids"]
        if len(enc) == 1:
            ids.append(int(enc[0]))
    return ids or list(range(len(ALPHABET)))


class FakeRollout:
    """``rlmix_generate`` without a language model: random completions of random length from a
    small alphabet, with consistent masks and behaviour log-probs. With a policy loaded, the
    behaviour log-probs are the policy's own log-probs of the drawn tokens (so importance ratios
    start at 1, as for on-policy samples); without one they are random negatives. Deterministic
    in ``train.seed``, the step and the number of calls made in that step (greedy requests are
    deterministic in the prompt texts alone)."""

    @hookimpl
    def rlmix_generate(self, run: Run, request: GenerationRequest) -> RolloutBatch:
        if request.temperature > 0:
            # sampling calls are counted per step (greedy ones, e.g. evaluation, are not), so a
            # resumed run draws what an uninterrupted one would
            calls = run.resources.setdefault(f"{ROLLOUT}.calls", {})
            call = calls.get(run.step, 0)
            calls[run.step] = call + 1
            key = f"{int(run.config.train.seed)}-{run.step}-{call}"
        else:
            key = "greedy-" + "|".join(str(p.messages) for p in request.prompts)
        gen = torch.Generator().manual_seed(random.Random(key).getrandbits(62))
        n_rows = len(request.prompts) * request.n
        prompt_ids, prompt_attn = _prompt_tokens(run, request.prompts)
        prompt_ids = prompt_ids.repeat_interleave(request.n, 0)
        prompt_attn = prompt_attn.repeat_interleave(request.n, 0)
        width = max(1, int(request.max_new_tokens))
        alphabet = torch.tensor(_alphabet_ids(run))
        completion = alphabet[torch.randint(0, len(alphabet), (n_rows, width), generator=gen)]
        lengths = torch.randint(1, width + 1, (n_rows,), generator=gen)
        cmask = (torch.arange(width)[None] < lengths[:, None]).float()
        pad = 0
        if run.policy is not None and run.policy.tokenizer.pad_token_id is not None:
            pad = int(run.policy.tokenizer.pad_token_id)
        completion = torch.where(cmask > 0, completion, torch.full_like(completion, pad))
        p_width = prompt_ids.shape[1]
        batch = RolloutBatch(
            group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
            tokens=torch.cat([prompt_ids, completion], 1),
            attention_mask=torch.cat([prompt_attn, cmask.long()], 1),
            completion_mask=torch.cat([torch.zeros(n_rows, p_width), cmask], 1),
            behavior_logp=torch.zeros(n_rows, p_width + width),
            policy_version=torch.full((n_rows,), run.policy_version, dtype=torch.long),
            texts=_texts(run, completion, cmask),
            prompts=[p for p in request.prompts for _ in range(request.n)],
        )
        if run.policy is not None:
            was_training = run.policy.model.training
            run.policy.model.eval()
            try:
                with torch.no_grad():
                    logp, _ = run.policy.logprobs(run, batch)
            finally:
                run.policy.model.train(was_training)
            batch.behavior_logp = (logp.float().cpu() * batch.completion_mask)
        else:
            noise = torch.rand(n_rows, p_width + width, generator=gen)
            batch.behavior_logp = -(0.1 + 3 * noise) * batch.completion_mask
        return batch


def _texts(run: Run, completion: torch.Tensor, cmask: torch.Tensor) -> list[str]:
    if run.policy is not None:
        rows = [c[m > 0].tolist() for c, m in zip(completion, cmask)]
        return [run.policy.tokenizer.decode(r, skip_special_tokens=True) for r in rows]
    return ["".join(ALPHABET[(t - 2) % len(ALPHABET)] for t in c[m > 0].tolist())
            for c, m in zip(completion, cmask)]


class SimpleAlgorithm:
    """Advantage: reward minus the group mean. Loss: the on-policy policy gradient
    ``-A * exp(logp - sg(logp))`` (value ``-A``, gradient ``-A``), token-mean."""

    @hookimpl
    def rlmix_advantage(self, run: Run, batch: RolloutBatch) -> torch.Tensor:
        assert batch.rewards is not None
        return batch.rewards - ops.group_mean(batch.rewards, batch.group)

    @hookimpl
    def rlmix_clip(self, run: Run, mb: Minibatch, logp: torch.Tensor,
                   entropy: torch.Tensor) -> LossTerms:
        adv = mb.batch.token_advantages().to(logp.device, logp.dtype)
        mask = mb.batch.completion_mask.to(logp.device, logp.dtype)
        loss = -adv * torch.exp(logp - logp.detach())
        return LossTerms(loss=loss, mask=mask, mode="token-mean",
                         metrics={"kit/entropy": float(ops.masked_mean(entropy.detach(), mask))})


class Poison:
    """A probe, registered *after* the plugin under test: wraps ``rlmix_clip`` and makes the loss
    NaN, to check that ``rlmix_update`` skips a non-finite step."""

    @hookimpl(wrapper=True)
    def rlmix_clip(self, run: Run, mb: Minibatch, logp: torch.Tensor,
                   entropy: torch.Tensor) -> Any:
        terms = yield
        terms.loss = terms.loss * float("nan")
        return terms


STANDINS: dict[str, Any] = {ENV: FakeEnv, ROLLOUT: FakeRollout, ALGO: SimpleAlgorithm}
