"""The full-logits seam (``rlmix.distill``, hook ``rlmix_completion_logits``), the declared
not-needed hooks (``rlmix.needs``) and the privileged toy world of ``rlmix.testing``."""

from __future__ import annotations

import pytest
import torch

import rlmix
from rlmix import distill, loop, manifest, needs
from rlmix.errors import ManifestError, PluginError
from rlmix.testing import make_run
from rlmix.testing.privileged import PrivilegedToyPolicy, PrivilegedToyWorld, toy_world_run
from rlmix.types import RolloutBatch


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _model_batch(run, prompts: list[str], completion: list[list[int]]) -> RolloutBatch:
    """Rows ``template(prompt) + completion``, left-padded, as a rollout engine lays them out
    (completions start in the same column; the second completion is one token shorter)."""
    tok = run.policy.tokenizer
    ids = [tok(run.policy.chat_text(_chat(p)), add_special_tokens=False)["input_ids"]
           for p in prompts]
    width = max(len(i) for i in ids)
    rows, attn, cmask = [], [], []
    for prefix, comp in zip(ids, completion, strict=True):
        fill = width - len(prefix)
        pad = len(completion[0]) - len(comp)
        rows.append([0] * fill + prefix + comp + [0] * pad)
        attn.append([0] * fill + [1] * (len(prefix) + len(comp)) + [0] * pad)
        cmask.append([0] * width + [1] * len(comp) + [0] * pad)
    n = len(rows)
    return RolloutBatch(group=torch.arange(n), tokens=torch.tensor(rows),
                        attention_mask=torch.tensor(attn), completion_mask=torch.tensor(
                            cmask, dtype=torch.float), behavior_logp=torch.zeros(n, len(rows[0])),
                        policy_version=torch.zeros(n, dtype=torch.long),
                        prompts=[rlmix.Prompt(messages=_chat(p)) for p in prompts])


@pytest.fixture(scope="module")
def tiny_run():
    run = make_run(with_policy=True)
    return run


def test_default_logits_agree_with_policy_logprobs(tiny_run):
    run = tiny_run
    batch = _model_batch(run, ["What is 2+2?", "Hi"], [[65, 66, 67, 68], [69, 70, 71]])
    first = distill.first_completion_column(batch)
    assert first == batch.tokens.shape[1] - 4
    logits = distill.completion_logits(run, batch)
    assert logits.shape == (2, 4, run.policy.model.config.vocab_size)
    assert logits.requires_grad  # the student's forward keeps the gradient
    logp, _ = run.policy.logprobs(run, batch)
    mask = distill.completion_region(batch)
    from_logits = torch.log_softmax(logits, -1).gather(
        -1, batch.tokens[:, first:, None]).squeeze(-1)
    torch.testing.assert_close(from_logits * mask, logp[:, first:].detach() * mask,
                               atol=1e-5, rtol=1e-5)


def test_teacher_under_the_rows_own_messages_is_the_student(tiny_run):
    run = tiny_run
    batch = _model_batch(run, ["What is 2+2?", "Hi"], [[65, 66, 67, 68], [69, 70, 71]])
    mask = distill.completion_region(batch)[..., None]
    student = distill.completion_logits(run, batch).detach()
    same = distill.teacher_logits(run, batch, [p.messages for p in batch.prompts])
    assert not same.requires_grad
    torch.testing.assert_close(same * mask, student * mask, atol=1e-4, rtol=1e-4)
    # another prompt (longer than both) changes the distributions, and the alignment holds:
    # a batch built with that prompt gives the same logits as the teacher pass
    other = "The answer is 4. What is 2+2? Think it through."
    teacher = distill.teacher_logits(run, batch, [_chat(other), _chat(other)])
    assert float(((teacher - student).abs() * mask).max()) > 1e-3
    rebuilt = _model_batch(run, [other, other], [[65, 66, 67, 68], [69, 70, 71]])
    torch.testing.assert_close(teacher * mask, distill.completion_logits(run, rebuilt).detach()
                               * mask, atol=1e-4, rtol=1e-4)


def test_completion_logits_checks_rows_and_shape(tiny_run):
    batch = _model_batch(tiny_run, ["a"], [[65, 66]])
    with pytest.raises(ValueError, match="message lists"):
        distill.completion_logits(tiny_run, batch, [_chat("a"), _chat("b")])

    class Wrong:
        @rlmix.hookimpl
        def rlmix_completion_logits(self, run, batch, messages):
            return torch.zeros(len(batch), 1, 3)

    run = make_run({"wrong": Wrong()})
    with pytest.raises(RuntimeError, match="shape"):
        distill.completion_logits(run, batch)


# ---------------------------------------------------------------- rlmix.needs


class RewardFree:
    """A loss-only plugin that declares it needs neither a reward nor an advantage."""

    RLMIX_NOT_NEEDED = ("rlmix_score", "rlmix_advantage")

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        return rlmix.LossTerms(loss=-logp, mask=mb.batch.completion_mask)


class LossOnly:
    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        return rlmix.LossTerms(loss=-logp, mask=mb.batch.completion_mask)


class Engine:
    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        return []

    @rlmix.hookimpl
    def rlmix_generate(self, run, request):
        return None


def test_a_declared_plugin_lets_a_manifest_go_without_scorer_and_advantage():
    cfg = manifest.read(None, ["model=tiny-random", "plugins=[engine,free]"])
    loop.prepare(cfg, extra_plugins={"engine": Engine(), "free": RewardFree()})
    cfg = manifest.read(None, ["model=tiny-random", "plugins=[engine,loss]"])
    with pytest.raises(ManifestError, match="rlmix_score.*rlmix_advantage"):
        loop.prepare(cfg, extra_plugins={"engine": Engine(), "loss": LossOnly()})


def test_only_score_and_advantage_may_be_declared():
    class Greedy:
        RLMIX_NOT_NEEDED = ("rlmix_clip",)

    with pytest.raises(PluginError, match="rlmix_clip"):
        needs.declared(Greedy())
    assert needs.declared(RewardFree()) == {"rlmix_score", "rlmix_advantage"}
    assert needs.required_hooks([LossOnly()], {"rlmix_score": "x"}) == {"rlmix_score": "x"}


# ---------------------------------------------------------------- the privileged toy world


def _world(seed: int = 0) -> PrivilegedToyWorld:
    answers = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 1]])
    shift = torch.zeros(4, 2, 6)
    shift.scatter_(-1, answers[..., None], 5.0)  # the answer view points at the answer
    policy = PrivilegedToyPolicy(4, 2, 6, views={"Answer:": shift}, seed=seed)
    return PrivilegedToyWorld(policy, answers)


def test_a_privileged_view_shifts_the_shared_table():
    world = _world()
    pol = world.policy
    plain = pol.table([1], [_chat("task 1")])
    privileged = pol.table([1], [_chat("task 1\nAnswer: 2 3")])
    torch.testing.assert_close(privileged - plain, pol.views["Answer:"][1:2])
    p_plain = float(pol.answer_prob(world.answers, [1])[0])
    assert p_plain == pytest.approx(1 / 36)
    expected = (torch.e**5 / (torch.e**5 + 5)) ** 2
    assert float(pol.answer_prob(world.answers, [1], [_chat("Answer:")])[0]) == pytest.approx(
        expected, rel=1e-5)


def test_the_loop_runs_a_reward_free_step_on_the_toy_world():
    world = _world()
    run = toy_world_run(world, {"free": RewardFree()}, scorer=False)
    before = world.policy.logits.detach().clone()
    metrics = loop.train_step(run)
    assert metrics["reward/mean"] == 0.0
    assert world.generated_rows == 32  # 4 prompts x 8
    assert not torch.equal(before, world.policy.logits.detach())
    batch = world.rlmix_generate(run, rlmix.GenerationRequest(prompts=[world.prompt(0)], n=3))
    logits = distill.completion_logits(run, batch)
    assert logits.shape == (3, 2, 6)
    logp, _ = world.policy.logprobs(run, batch)
    torch.testing.assert_close(torch.log_softmax(logits, -1).gather(
        -1, batch.tokens[:, 1:, None]).squeeze(-1), logp[:, 1:])
    torch.testing.assert_close(batch.behavior_logp, logp.detach())


def test_forced_completions_follow_the_source_rows_prompts():
    world = _world()
    run = toy_world_run(world, {})
    batch = world.rlmix_generate(run, rlmix.GenerationRequest(
        prompts=[world.prompt(0), world.prompt(2)], n=2))
    forced = distill.forced_completions(run, batch, [0, 2], [[1, 2], [3]])
    assert forced.tokens.tolist() == [[0, 1, 2], [2, 3, 0]]
    assert forced.completion_mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert forced.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert [p.id for p in forced.prompts] == ["0", "2"]
    logp, _ = world.policy.logprobs(run, forced)
    torch.testing.assert_close(forced.behavior_logp, logp.detach())
    assert forced.group.tolist() == [0, 1]


def test_stop_token_is_what_early_rows_end_with_and_texts_are_decoded(tiny_run):
    run = tiny_run
    batch = _model_batch(run, ["a", "b"], [[65, 66, 67, 68], [69, 70, 9]])
    assert distill.stop_token(run, batch) == 9  # row 2 stopped early on token 9
    full = _model_batch(run, ["a"], [[65, 66]])
    assert distill.stop_token(run, full) == run.policy.tokenizer.eos_token_id
    hi = run.policy.tokenizer("Hi", add_special_tokens=False)["input_ids"]
    forced = distill.forced_completions(run, batch, [0], [hi])
    assert forced.texts == ["Hi"]  # what a scorer reads is the decoded completion
