"""KTO with step verification: step ids, labels, the judge (scripted, malformed verdicts), the
KTO loss by hand, the sanity claim (all-positive labels: SFT's direction), the claim against SFT
on positives only on a toy policy, and the example manifest on tiny-random."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import rlmix_kto as kto
import torch
from omegaconf import OmegaConf
from rlmix_lm.judges import ScriptedJudge, every_kth_malformed

import rlmix
from rlmix import cli, loop
from rlmix.testing import ToyPolicy, make_batch, make_run, skip_unless_installed, toy_train
from rlmix.types import LossTerms, Minibatch, Normalizers, Prompt

EXAMPLE = Path(kto.__file__).parents[4] / "examples" / "rewards" / "kto-arith.yaml"

# ---------------------------------------------------------------- steps and labels


def test_token_step_ids_with_and_without_separator_ends():
    cmask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]).float()
    assert kto.token_step_ids(cmask).tolist() == [[-1, 0, 1, 2, 3], [-1, 0, 1, -1, -1]]
    ends = torch.tensor([[0, 0, 1, 0, 0], [0, 1, 0, 0, 0]]).bool()
    # a step ends on a token holding the separator; the next token starts a new step
    assert kto.token_step_ids(cmask, ends).tolist() == [[-1, 0, 0, 1, 1], [-1, 0, 1, -1, -1]]


def test_separator_ends_and_step_texts_agree():
    vocab = {1: "3+4", 2: "=7\n", 3: "so", 4: " 7"}
    tokens = torch.tensor([[0, 1, 2, 3, 4]])
    cmask = torch.tensor([[0, 1, 1, 1, 1]]).float()
    ends = kto.separator_ends(tokens, cmask, vocab.__getitem__, "\n")
    assert ends.tolist() == [[False, False, True, False, False]]
    assert kto.step_texts("3+4=7\nso 7", "\n") == ["3+4=7", "so 7"]
    assert kto.step_texts("a\nb\n", "\n") == ["a", "b"]


def test_token_labels_from_step_labels():
    ids = torch.tensor([[-1, 0, 0, 1, 2]])
    got = kto.token_labels(ids, [[True, None]])  # step 1 unlabelled, step 2 past the list
    assert got.tolist() == [[0, 1, 1, 0, 0]]
    got = kto.token_labels(ids, [[False, True, False]])
    assert got.tolist() == [[0, -1, -1, 1, -1]]


def labels_verdict(text):
    """Desirable unless a step says "wrong"; one label per numbered step."""
    steps = [line for line in text.split("<<<STEPS\n")[1].split("\nSTEPS>>>")[0].splitlines()]
    return {"labels": ["wrong" not in s for s in steps]}


def test_judge_labels_and_malformed_replies_leave_rows_unlabelled():
    judge = ScriptedJudge(every_kth_malformed(2, labels_verdict))
    labels, malformed = kto.judge_labels(judge, ["q1", "q2", "q3"],
                                         [["ok", "wrong"], ["ok"], ["wrong", "ok", "ok"]])
    assert labels == [[True, False], [], [False, True, True]]
    assert malformed == 1 and judge.calls == 3
    assert "[2] wrong" in judge.prompts[0] and "q1" in judge.prompts[0]
    # a reply with the wrong number of labels, or non-booleans, is malformed too
    for reply in ({"labels": [True]}, {"labels": [1, 0]}, {"labels": "yes"}):
        got, bad = kto.judge_labels(ScriptedJudge(lambda t, r=reply: r), ["q"], [["a", "b"]])
        assert got == [[]] and bad == 1


# ---------------------------------------------------------------- the KTO loss by hand


def test_kto_loss_by_hand():
    # row 0: steps {1,2} desirable and {3} undesirable; row 1: one desirable step
    logp = torch.tensor([[0.0, -1.0, -1.0, -2.0], [0.0, -0.5, 0.0, 0.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0, -1.0], [0.0, -1.0, 0.0, 0.0]])
    ids = torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]])
    labels = torch.tensor([[0, 1, 1, -1], [0, 1, 0, 0]]).float()
    beta = 2.0
    loss, mask, metrics = kto.kto_loss(logp, ref, ids, labels, beta, 1.0, 0.5)
    r = [0.5, -1.0, 0.5]  # step log-ratios: row 0 step 0, row 0 step 1, row 1 step 0
    z = max(0.0, sum(r) / 3)  # 0
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    l00 = 1 - sig(beta * (r[0] - z))
    l01 = 0.5 - 0.5 * sig(beta * (z - r[1]))
    l10 = 1 - sig(beta * (r[2] - z))
    expected = torch.tensor([[0, l00 / 2, l00 / 2, l01], [0, l10, 0, 0]])
    torch.testing.assert_close(loss, expected)
    assert mask.tolist() == [[0, 1, 1, 1], [0, 1, 0, 0]]
    assert metrics["kto/z_ref"] == 0.0
    assert metrics["kto/reward_margin"] == pytest.approx((0.5 + 0.5) / 2 + 1.0)
    # z is clamped at 0 and detached; a positive mean log-ratio shifts both sides
    loss2, _, m2 = kto.kto_loss(logp + 1.0, ref, ids, labels, beta)
    # (+1 per token: step 0 of row 0 has two tokens) -> r = 2.5, 0.0, 1.5
    assert m2["kto/z_ref"] == pytest.approx((2.5 + 0.0 + 1.5) / 3)


def test_all_positive_labels_give_the_sft_direction():
    """The sanity claim: at the reference point, KTO with every step desirable moves the
    weights along SFT's gradient (cosine 1)."""
    policy = ToyPolicy(vocab=6, length=4, seed=0)
    with torch.no_grad():
        policy.logits.normal_()
    batch = policy.sample(4, 8)
    ids = kto.token_step_ids(batch.completion_mask)
    labels = batch.completion_mask.clone()  # every step desirable
    logp, _ = policy.logprobs(batch)
    loss, mask, _ = kto.kto_loss(logp, logp.detach(), ids, labels, beta=0.1)
    (grad_kto,) = torch.autograd.grad((loss * mask).sum(), policy.logits)
    logp, _ = policy.logprobs(batch)
    (grad_sft,) = torch.autograd.grad((-logp * batch.completion_mask).sum(), policy.logits)
    cos = torch.nn.functional.cosine_similarity(grad_kto.flatten(), grad_sft.flatten(), dim=0)
    assert float(cos) == pytest.approx(1.0, abs=1e-6)
    # and the scale is lambda_D * beta * sigmoid'(0) = 0.1 / 4
    torch.testing.assert_close(grad_kto, grad_sft * 0.025)


# ---------------------------------------------------------------- the hooks


class Outcome:
    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        return {"ok": torch.tensor([float(i["ok"]) for i in batch.info])}


def test_hooks_outcome_labels_advantage_and_clip_through_the_core():
    run = make_run({"outcome": Outcome(), "kto": kto},
                   ["kto.verifier=outcome", "kto.outcome_term=outcome.ok", "kto.steps=tokens",
                    "kto.reference=behavior"])
    batch = make_batch(n_groups=1, group_size=2)
    batch.info = [{"ok": 1}, {"ok": 0}]
    loop.score(run, batch)
    labels = batch.extras[kto.LABEL_KEY]
    assert (labels[0][batch.completion_mask[0] > 0] == 1).all()
    assert (labels[1][batch.completion_mask[1] > 0] == -1).all()
    assert batch.reward_terms["kto.desirable"].tolist() == [1.0, 0.0]
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    assert torch.equal(adv, labels)
    batch.advantages = adv
    logp = batch.behavior_logp.clone().requires_grad_(True)
    mb = Minibatch(batch=batch, normalizers=Normalizers(10.0, 2.0, 5.0))
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=torch.zeros_like(logp))
    assert terms.mode == "seq-mean-token-sum"
    # at r = 0 every step's loss is lambda - sigmoid(0) = 0.5, spread over one token each
    assert torch.allclose(terms.loss[terms.mask > 0], torch.tensor(0.5))


def test_judge_verifier_through_the_core_counts_cost_and_malformed():
    run = make_run({"kto": kto}, ["kto.verifier=judge"], with_policy=True)
    run.resources["kto.lm"] = ScriptedJudge(every_kth_malformed(2, labels_verdict))
    batch = make_batch(n_groups=1, group_size=2)
    batch.texts = ["fine\nwrong", "x"]
    batch.prompts = [Prompt(messages=[{"role": "user", "content": "q"}])] * 2
    loop.score(run, batch)
    assert run.pending_metrics["kto/judge_calls"] == 2
    assert run.pending_metrics["kto/malformed"] == 1
    assert batch.info[1]["kto"]["labels"] == []  # malformed: unlabelled, no loss
    assert (batch.extras[kto.LABEL_KEY][1] == 0).all()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="verifier"):
        kto.Settings(verifier="gpt4o")
    with pytest.raises(ValueError, match="outcome_term"):
        kto.Settings(verifier="outcome")
    with pytest.raises(ValueError, match="beta"):
        kto.Settings(beta=0)


# ---------------------------------------------------------------- the claim on a toy policy

TARGET = [1, 2, 3, 4]
TRAP = 6.0  # the starting policy's logit for a wrong token at every step: p(right) = 0.0024


class StepWorld:
    """A 4-step task: step t is right when its token is TARGET[t]; the task is solved when
    every step is. The step verifier's labels go in ``batch.info[i]["step_labels"]``."""

    def __init__(self) -> None:
        self.completions = 0

    def label(self, batch):
        right = batch.tokens[:, 1:] == torch.tensor(TARGET)
        for info, row in zip(batch.info, right.tolist()):
            info["step_labels"] = row
        self.completions += len(batch)

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        return {"solved": (batch.tokens[:, 1:] == torch.tensor(TARGET)).all(1).float()}


class SFTOnPositives:
    """The baseline: maximum likelihood on the desirable steps only (the same labels)."""

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        positive = (mb.batch.extras[kto.LABEL_KEY] > 0).to(logp.dtype)
        return LossTerms(loss=-logp * positive, mask=positive, mode="seq-mean-token-sum")


def solve_rate(policy: ToyPolicy) -> float:
    """The exact probability that a sample solves the task."""
    p = torch.softmax(policy.logits.detach(), -1)
    return float(torch.prod(p[torch.arange(len(TARGET)), torch.tensor(TARGET)]))


def _train(arm: str, seed: int, steps: int = 100):
    world = StepWorld()
    plugins = {"world": world, "kto": kto}
    if arm == "sft":
        plugins["sft"] = SFTOnPositives()  # listed last: it owns rlmix_clip
    run = make_run(plugins, ["kto.verifier=info", "kto.steps=tokens", "kto.beta=0.1",
                             "score.weights.kto.desirable=0"])
    policy = ToyPolicy(vocab=6, length=4, seed=seed)
    with torch.no_grad():
        policy.logits[:, 0] = TRAP
    reference = copy.deepcopy(policy)
    run.plugin_resources("kto")["ref_logprobs"] = (
        lambda batch: reference.logprobs(batch)[0].detach())
    first = []

    def reward(batch):
        world.label(batch)
        loop.score(run, batch)
        if not first:
            first.append(batch.tokens.clone())
        return batch.reward_terms["world.solved"]

    toy_train(run, policy, reward, steps=steps, lr=0.05, n_prompts=4, group_size=8)
    return solve_rate(policy), world.completions, first[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_claim_kto_beats_sft_on_positives_in_100_steps(seed):
    kto_rate, kto_n, kto_first = _train("kto", seed)
    sft_rate, sft_n, sft_first = _train("sft", seed)
    assert kto_n == sft_n == 100 * 32 and torch.equal(kto_first, sft_first)
    # right steps are rare at the start; SFT learns only from them, KTO also pushes the
    # undesirable steps down, which makes right steps likelier on the next rollouts
    assert kto_rate >= 0.85
    assert sft_rate < 0.85


# ---------------------------------------------------------------- the example manifest


def test_example_manifest_runs_on_tiny_random(tmp_path):
    skip_unless_installed(EXAMPLE)
    cfg = OmegaConf.load(EXAMPLE)
    assert cfg.model == "tiny-random" and "kto" in cfg.plugins
    out = tmp_path / "ex"
    assert cli.main(["run", str(EXAMPLE), "train.steps=2", "arith.eval_size=2",
                     "arith.eval_max_new_tokens=4", "sampling.max_new_tokens=6",
                     "kto.lm.max_new_tokens=8", "log.progress=false", "log.plot=false",
                     "train.eval_every=0", f"out={out}"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["kto/judge_calls"] == 8 and "kto/malformed" in rows[-1]
