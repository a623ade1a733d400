"""SOLID: the safe evaluator (and what it refuses), artifact extraction, clustering and the
majority by hand, the NLL term, the hooks through the core, the sandbox executor, the claim on a
label-free arithmetic toy, and the example manifest on tiny-random."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import rlmix_solid as solid
import torch
from omegaconf import OmegaConf

import rlmix
from rlmix import cli, loop, ops
from rlmix.testing import ToyPolicy, make_batch, make_run, skip_unless_installed
from rlmix.types import LossTerms, Minibatch, Normalizers

EXAMPLE = Path(solid.__file__).parents[4] / "examples" / "rewards" / "solid-arith.yaml"

# ---------------------------------------------------------------- the evaluator


@pytest.mark.parametrize("text,value", [
    ("3+4", 7.0), ("(3)+(4)", 7.0), ("4 + 3", 7.0), ("1*(3+4)", 7.0), ("-2**2", -4.0),
    ("7/2", 3.5), ("7//2", 3.0), ("7%3", 1.0), ("2**10", 1024.0), ("19", 19.0), ("1e3", 1000.0)])
def test_safe_eval_values(text, value):
    assert solid.safe_eval(text) == value


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')", "x+1", "abs(-3)", "'a'*3", "True+1", "1/0", "5%0",
    "2**100000", "9**9**9", "10**16", "1e400", "(1).real", "[1,2]", "", "3 +", "0**-1",
    "1" * 500])
def test_safe_eval_refuses(text):
    assert solid.safe_eval(text) is None


def test_extract_artifact_defaults_and_regex():
    assert solid.extract_artifact("I add them.\n3 + 4 = 8\n") == "3 + 4"  # the claim is ignored
    assert solid.extract_artifact("") == ""
    assert solid.extract_artifact("x\n```python\nprint(7)\n```\n", "python") == "print(7)\n"
    assert solid.extract_artifact("print(7)", "python") == "print(7)"
    assert solid.extract_artifact("<e>2*3</e> ok", regex=r"<e>(.*?)</e>") == "2*3"
    assert solid.extract_artifact("none", regex=r"<e>(.*?)</e>") == ""


# ---------------------------------------------------------------- clusters by hand


def test_cluster_and_majority_by_hand():
    values = [7.0, 7.0000001, 8.0, None, 7.0, 8.0]
    ids = solid.cluster(values)
    assert ids == [0, 0, 1, -1, 0, 1]
    assert solid.majority(ids) == 0
    assert solid.majority([0, 0, 1, 1]) is None  # a tie is no majority
    assert solid.majority([0, 1, 2]) is None  # singletons are below min_votes 2
    assert solid.majority([0, 1, 2], min_votes=1) is None  # and still tied
    assert solid.majority([-1, -1]) is None
    # tolerance: relative 1e-3 puts 1000 and 1000.5 together
    assert solid.cluster([1000.0, 1000.5, 1002.0], atol=0, rtol=1e-3) == [0, 0, 1]


def test_pseudo_reference_equal_values_different_text_share_a_cluster():
    texts = ["3+4", "4 + 3", "(3)+(4)", "3*4", "1*(3+4)", "3-4", "12", "2*6"]
    values = [solid.safe_eval(t) for t in texts]
    group = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    member, reference = solid.pseudo_reference(values, group)
    # group 0: {3+4, 4 + 3, (3)+(4), 1*(3+4)} = 7 beats {3*4}; group 1: 12 and 2*6 beat -1
    assert member.tolist() == [1, 1, 1, 0, 1, 0, 1, 1]
    assert reference.tolist() == [1, 0, 0, 0, 0, 0, 1, 0]


def test_reference_nll_by_hand():
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, -4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    got = solid.reference_nll(logp, mask, torch.tensor([0.0, 1.0]))
    assert got.tolist() == [[0.0, 0.0, 0.0], [0.0, 3.0, 0.0]]


# ---------------------------------------------------------------- hooks


class Texts:
    """An owner of advantage and clip for hook tests: advantage 0, loss 0."""

    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        return torch.zeros(len(batch))

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        return LossTerms(loss=torch.zeros_like(logp), mask=mb.batch.completion_mask)


def test_score_hook_and_clip_wrapper_through_the_core():
    run = make_run({"owner": Texts(), "solid": solid}, ["solid.nll_coef=0.5"])
    batch = make_batch(n_groups=2, group_size=3)
    batch.texts = ["3+4", "4+3", "8", "hello", "2*5", "10"]
    loop.score(run, batch)
    assert batch.reward_terms["solid.membership"].tolist() == [1, 1, 0, 0, 1, 1]
    assert batch.extras[solid.REFERENCE_KEY].tolist() == [1, 0, 0, 0, 1, 0]
    assert run.pending_metrics["solid/executions"] == 6
    assert run.pending_metrics["solid/unexecutable"] == pytest.approx(1 / 6)
    assert batch.info[3]["solid"] == {"value": None, "member": False}
    logp = -torch.rand(6, batch.tokens.shape[1])
    mb = Minibatch(batch=batch, normalizers=Normalizers(1.0, 6.0, 5.0))
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=torch.zeros_like(logp))
    expected = -0.5 * logp * batch.completion_mask * torch.tensor([1, 0, 0, 0, 1, 0.0])[:, None]
    torch.testing.assert_close(terms.loss, expected)


def test_python_executor_runs_programs_in_the_sandbox():
    texts = ["```python\nprint(3+4)\n```", "print(7.0)", "import sys; sys.exit(1)",
             "print('seven')", "while True: pass"]
    values = solid.artifact_values(texts, solid.Settings(executor="python", timeout_s=1.0))
    assert values == [7.0, 7.0, None, None, None]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="executor"):
        solid.Settings(executor="shell")
    with pytest.raises(ValueError, match="capturing group"):
        solid.Settings(artifact_regex="<e>.*</e>")
    with pytest.raises(ValueError, match="nll_coef"):
        solid.Settings(nll_coef=-1)


# ---------------------------------------------------------------- the claim on a label-free toy

# the policy picks a strategy (position 0) and a spelling (position 1) for a prompt (a, b);
# strategy 0 is the right one; every spelling of a strategy has the same value
STRATEGIES = ["{a}+{b}", "{a}-{b}", "{a}*{b}", "{a}+{b}+1", "{b}-{a}", "{a}+{b}-1"]
SPELLINGS = ["{e}", "({e})", "1*({e})", "({e})*1", "{e}+0", "0+{e}"]


def render(strategy: int, spelling: int, a: int, b: int) -> str:
    return SPELLINGS[spelling].format(e=STRATEGIES[strategy].format(a=a, b=b))


class LabelFreeArith:
    """Prompts (a, b) with a != b in 1..9, a fresh draw per group; the completion text is the
    rendered expression. ``correct`` (the label) is returned for logging and for the labelled
    baseline; label-free runs weight it 0."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.completions = 0

    def render(self, batch):
        pairs = [self.rng.sample(range(1, 10), 2) for _ in range(batch.num_groups)]
        draws = batch.tokens[:, 1:].tolist()
        batch.texts = [render(d[0], d[1], *pairs[g]) for d, g in zip(draws, batch.group.tolist())]
        batch.extras["correct"] = torch.tensor(
            [float(solid.safe_eval(t) == sum(pairs[g])) for t, g in
             zip(batch.texts, batch.group.tolist())])
        self.completions += len(batch)

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        return {"correct": batch.extras["correct"]}


class GroupNormPG:
    """GRPO on the toy: group-normalised advantages, on-policy clipped surrogate."""

    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        r = batch.rewards
        return (r - ops.group_mean(r, batch.group)) / (ops.group_std(r, batch.group) + 1e-6)

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        loss, _ = ops.clipped_surrogate(logp, logp.detach(), mb.batch.token_advantages(), 0.2,
                                        0.2)
        return LossTerms(loss=loss, mask=mb.batch.completion_mask, mode="token-mean")


def heldout_accuracy(policy: ToyPolicy) -> float:
    """Held-out accuracy, exactly: the toy's policy ignores the prompt, and on any pair a != b
    in 1..9 only strategy 0 gives a + b (a * b = a + b needs a = b = 2), so the expected
    accuracy on fresh prompts is the probability of strategy 0 (no sampling noise)."""
    return float(torch.softmax(policy.logits.detach()[0], -1)[0])


def test_heldout_accuracy_is_the_sampled_accuracy_on_fresh_pairs():
    policy = ToyPolicy(vocab=6, length=2, seed=5)
    with torch.no_grad():
        policy.logits[0] = torch.tensor([1.5, 0.0, -1.0, 0.5, 0.0, 0.0])
    world = LabelFreeArith(99)
    batch = policy.sample(128, 8)
    world.render(batch)
    assert float(batch.extras["correct"].mean()) == pytest.approx(heldout_accuracy(policy),
                                                                  abs=0.03)


class TextVote:
    """The baseline: the same majority vote, on the completion's text instead of its value."""

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        ids: dict[str, int] = {}
        values = [float(ids.setdefault(t, len(ids))) for t in batch.texts]
        membership, _ = solid.pseudo_reference(values, batch.group, atol=0.0, rtol=0.0)
        return {"membership": membership}


def policy_loop(run, policy: ToyPolicy, reward, steps: int, optimizer) -> None:
    """``toy_train`` with the optimiser chosen by the caller (Adam there)."""
    for step in range(steps):
        run.step = step
        batch = policy.sample(4, 8)
        batch.rewards = reward(batch).float()
        batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
        logp, entropy = policy.logprobs(batch)
        norm = Normalizers(tokens=float(batch.completion_mask.sum()), sequences=float(len(batch)),
                           norm_constant=float(policy.length))
        terms = run.hook.rlmix_clip(run=run, mb=Minibatch(batch=batch, normalizers=norm),
                                    logp=logp, entropy=entropy)
        loss = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, norm)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _train(arm: str, seed: int, steps: int = 20, nll_coef: float = 4.0, adam: bool = False):
    """arm: labelled (GRPO on the label) | solid (membership + ``nll_coef`` NLL) | solid0
    (lambda = 0) | text (majority of identical texts). SGD (lr 0.5) unless ``adam`` (lr
    0.05). Returns the held-out accuracy, the completions and whether each group's
    pseudo-reference was right."""
    world = LabelFreeArith(seed)
    plugins = {"world": world, "pg": GroupNormPG()}
    overrides = []
    if arm == "text":
        plugins["text"] = TextVote()
        overrides = ["score.weights.world.correct=0"]
    elif arm != "labelled":
        plugins["solid"] = solid
        overrides = ["score.weights.world.correct=0",
                     f"solid.nll_coef={nll_coef if arm == 'solid' else 0.0}"]
    run = make_run(plugins, overrides)
    policy = ToyPolicy(vocab=6, length=2, seed=seed)
    with torch.no_grad():  # a pretrained prior: the right strategy is the likeliest one
        policy.logits[0, 0] = 1.0
    majority_right = []

    def reward(batch):
        world.render(batch)
        loop.score(run, batch)
        if arm in ("solid", "solid0"):
            ref = batch.extras[solid.REFERENCE_KEY].bool()
            majority_right.extend(batch.extras["correct"][ref].tolist())
        return batch.rewards

    optimizer = (torch.optim.Adam(policy.parameters(), lr=0.05) if adam else
                 torch.optim.SGD(policy.parameters(), lr=0.5))
    policy_loop(run, policy, reward, steps, optimizer)
    return heldout_accuracy(policy), world.completions, majority_right


def test_the_nll_term_reaches_the_loss_on_the_reference_rows():
    """The dense term's gradient: on the pseudo-reference rows' tokens only, pushing up the
    majority's strategy (position 0) on top of the membership advantage's push."""
    grads = {}
    for coef in (0.0, 4.0):
        world = LabelFreeArith(0)
        run = make_run({"world": world, "pg": GroupNormPG(), "solid": solid},
                       ["score.weights.world.correct=0", f"solid.nll_coef={coef}"])
        policy = ToyPolicy(vocab=6, length=2, seed=0)
        batch = policy.sample(4, 8)
        world.render(batch)
        loop.score(run, batch)
        batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
        logp, entropy = policy.logprobs(batch)
        norm = Normalizers(tokens=64.0, sequences=32.0, norm_constant=2.0)
        terms = run.hook.rlmix_clip(run=run, mb=Minibatch(batch=batch, normalizers=norm),
                                    logp=logp, entropy=entropy)
        ops.aggregate_loss(terms.loss, terms.mask, terms.mode, norm).backward()
        grads[coef] = policy.logits.grad.clone()
        reference = batch.extras[solid.REFERENCE_KEY].bool()
    extra = grads[4.0] - grads[0.0]
    # by hand: 4 * sum over reference rows of d(-log p(token))/d logits = 4 * (softmax - onehot)
    # (uniform policy: softmax 1/6), over the 64 tokens of the token-mean
    expected = torch.zeros(2, 6)
    for row in batch.tokens[reference, 1:].tolist():
        for pos, tok in enumerate(row):
            expected[pos] += torch.full((6,), 1 / 6) - torch.nn.functional.one_hot(
                torch.tensor(tok), 6).float()
    torch.testing.assert_close(extra, 4.0 * expected / 64.0)
    assert int(reference.sum()) >= 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_claim_label_free_solid_tracks_labelled_grpo(seed):
    """Under SGD: SOLID (lambda 4) >= lambda 0 (here strictly, by > 0.03), within 0.1 of
    labelled GRPO; voting on text more than 0.1 behind. Under Adam the NLL term changes
    nothing measurable (our finding, README): asserted on seed 0 as |SOLID - lambda 0| <= 0.03."""
    steps = 20
    results = {arm: _train(arm, seed, steps) for arm in ("labelled", "solid", "solid0", "text")}
    assert {r[1] for r in results.values()} == {steps * 32}  # the same rollouts for every arm
    acc = {arm: r[0] for arm, r in results.items()}
    right = results["solid"][2]
    assert sum(right) / len(right) >= 0.6  # the premise: the majority is mostly right
    assert acc["solid"] >= acc["labelled"] - 0.1  # label-free, within 0.1 of labelled GRPO
    assert acc["text"] < acc["labelled"] - 0.1  # voting on text misses: spellings split votes
    assert acc["solid"] > acc["solid0"] + 0.03  # the dense term adds to the membership term
    if seed == 0:  # the null result under Adam, on one seed (the scan is in the README)
        adam = {arm: _train(arm, seed, steps, adam=True)[0] for arm in ("solid", "solid0")}
        assert abs(adam["solid"] - adam["solid0"]) <= 0.03  # Adam absorbs it


# ---------------------------------------------------------------- the example manifest


def test_example_manifest_runs_on_tiny_random(tmp_path):
    skip_unless_installed(EXAMPLE)
    cfg = OmegaConf.load(EXAMPLE)
    assert cfg.model == "tiny-random" and "solid" in cfg.plugins
    out = tmp_path / "ex"
    assert cli.main(["run", str(EXAMPLE), "train.steps=2", "arith.eval_size=2",
                     "arith.eval_max_new_tokens=4", "sampling.max_new_tokens=6",
                     "log.progress=false", "log.plot=false", "train.eval_every=0",
                     f"out={out}"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert "reward/solid.membership" in rows[-1] and "solid/executions" in rows[-1]
