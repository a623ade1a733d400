"""Tests of SAGE: the rule abstraction and the raw transcript by hand, the token cut, the
``rlmix_generate`` wrapper (first pass, second execution, the caller's list untouched), the LM
path, and the claim on scripted multi-turn workflows at two rollouts per task: second pass
with the abstraction, two plain samples, and a retry given the raw transcript cut to the
abstraction's token count."""

from __future__ import annotations

import pytest
import rlmix_sage_abstraction as sage
from rlmix_lm.chat_server import ScriptedLM

import rlmix
from rlmix import loop
from rlmix.testing import example_resumes, make_run
from rlmix.testing.memory_worlds import (
    ScriptedAgentEngine,
    Workflow,
    WorkflowEnv,
    workflow_agent,
)
from rlmix.types import GenerationRequest

EXAMPLE = sage.__file__.rsplit("/plugins/", 1)[0] + "/examples/harness/sage_abstraction-arith.yaml"


def turn(action, state, error="", observation="ok"):
    info = {"state": state, **({"error": error} if error else {})}
    return {"assistant": f"<tool>{action}</tool>", "info": info,
            "messages": [{"role": "tool", "content": observation}]}


# ---------------------------------------------------------------- by hand


def test_rule_plan_and_transcript_by_hand():
    s = sage.Settings()
    turns = [turn("peek", "start", "peek needs a token", "error: peek needs a token"),
             turn("open", "s1", observation="ok. state: s1"),
             turn("peek", "start", "x")]  # made in s1; the env reports state start after it
    lines = sage.rule_plan(turns, "", 0.0, "", s)
    assert lines == ["- in state start: `peek` fails: peek needs a token",
                     "- in state start: use `open` (then s1)",
                     "- in state s1: `peek` fails: x",
                     "- outcome: score 0, ended in state start"]
    raw = sage.transcript(turns[:2], "", "", s)
    assert raw == ("state start: called `peek` -> error: peek needs a token\n"
                   "state start: called `open` -> ok. state: s1")
    single = sage.rule_plan(None, "45", 0.0, "answer: 46", s)
    assert single == ["- your answer was: 45", "- its score: 0", "- the checker said: answer: 46"]
    assert sage.cut_tokens("a b c d e", 3) == "a b c" and sage.count_tokens("a b c") == 3


class Recorder:
    def __init__(self):
        self.batches = []

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        self.batches.append(batch)
        return {}


# five workflows; the agent has 6 calls per episode and tries offered calls in order; every
# observation carries a page of text, as a web or tool env's would
PAGE = ("Portal v2. Your session is active; saved drafts are kept for 30 days. Help, terms and "
        "privacy are linked below. Last login from a known device.")
FLOWS = {
    "w0": Workflow(moves={"start": {"open": "s1"}, "s1": {"fill": "s2"}, "s2": {"submit": "done"}},
                   broken={"start": {"peek": "peek needs a session token first",
                                     "poke": "poke is only allowed after open"},
                           "s1": {"guess": "guess is not a form field",
                                  "skip": "skip would lose the form"},
                           "s2": {"send": "send needs a filled form id",
                                  "post": "post is deprecated here"}}),
    "w1": Workflow(moves={"start": {"login": "in"}, "in": {"logout": "done"}},
                   broken={"start": {"a1": "a1 is refused", "a2": "a2 is refused",
                                     "a3": "a3 is refused"},
                           "in": {"b1": "b1 is refused", "b2": "b2 is refused",
                                  "b3": "b3 is refused"}}),
    "w2": Workflow(moves={"start": {"k0": "t1"}, "t1": {"k1": "t2"}, "t2": {"k2": "t3"},
                          "t3": {"k3": "done"}},
                   broken={"start": {"x0": "x0 fails"}, "t1": {"x1": "x1 fails"},
                           "t2": {"x2": "x2 fails"}, "t3": {"x3": "x3 fails"}}),
    "w3": Workflow(moves={"start": {"go": "deep"}, "deep": {"exit": "done"}},
                   broken={"deep": {f"d{j}": f"d{j} is a dead end" for j in range(5)}}),
    "w4": Workflow(moves={"start": {"finish": "done"}}),
}


def workflow_run(tmp_path, *overrides, plugin=True, page=PAGE):
    flows = {k: Workflow(f.moves, f.broken, f.offers, page) for k, f in FLOWS.items()}
    env, engine, rec = WorkflowEnv(flows), ScriptedAgentEngine(workflow_agent, 6), Recorder()
    plugins = {"workflowenv": env, "agent": engine, "recorder": rec}
    if plugin:
        plugins["sage_abstraction"] = sage
    run = make_run(plugins, [f"out={tmp_path}", "train.prompts_per_step=5", "train.group_size=1",
                             "train.mode=harness-only", *overrides], with_policy=True)
    loop.configure(run)
    return run, engine, rec


def solved(batch, rows):
    return [float(batch.rewards[r]) for r in rows]


def test_claim_second_pass_with_the_abstraction(tmp_path):
    prompts_of = lambda run: run.hook.rlmix_prompts(run=run, step=0)  # noqa: E731
    # SAGE: one first rollout + one second execution per task
    run, engine, _ = workflow_run(tmp_path / "sage", "sage_abstraction.max_tokens=512")
    batch = run.generate(prompts_of(run), n=1)
    loop.score(run, batch)
    sage_acc = [float(v) for v in batch.reward_terms["workflowenv.correct"]]
    tokens = [p.info["sage_abstraction"]["tokens"] for p in batch.prompts]
    # two independent plain samples per task (any of the two counts)
    plain, plain_engine, _ = workflow_run(tmp_path / "plain", plugin=False)
    pb = plain.generate(prompts_of(plain), n=2)
    loop.score(plain, pb)
    pc = pb.reward_terms["workflowenv.correct"].view(5, 2)
    plain_acc = [float(v) for v in pc.max(dim=1).values]
    # a retry given the raw first transcript cut to the abstraction's token count
    raw, raw_engine, _ = workflow_run(tmp_path / "raw", "sage_abstraction.context=raw",
                                      "sage_abstraction.max_tokens=512")
    rb = raw.generate(prompts_of(raw), n=1)
    loop.score(raw, rb)
    raw_acc = [float(v) for v in rb.reward_terms["workflowenv.correct"]]
    raw_tokens = [p.info["sage_abstraction"]["tokens"] for p in rb.prompts]
    budgets = [p.info["sage_abstraction"]["budget"] for p in rb.prompts]
    # the same budget: two rollouts per task for all three, the raw context no longer than
    # the abstraction it stands in for
    assert engine.episodes == plain_engine.episodes == raw_engine.episodes == 10
    assert budgets == tokens and all(r <= t for r, t in zip(raw_tokens, tokens))
    s, p, r = sum(sage_acc) / 5, sum(plain_acc) / 5, sum(raw_acc) / 5
    assert s >= 0.75 and p <= 0.3 and r < s, (sage_acc, plain_acc, raw_acc)
    assert run.state["sage_abstraction"]["first_rollouts"] == 5
    print(f"sage claim: second-pass accuracy {s:.2f} with the abstraction, {p:.2f} for two plain "
          f"samples (pass@2), {r:.2f} for a retry on the raw transcript cut to the same tokens "
          f"(mean {sum(tokens) / 5:.0f} tokens)")


def test_wrapper_keeps_the_callers_list_and_runs_in_training(tmp_path):
    run, engine, rec = workflow_run(tmp_path)
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    before = [p.messages[-1]["content"] for p in prompts]
    batch = run.generate(prompts, n=1)
    assert [p.messages[-1]["content"] for p in prompts] == before
    assert all("Plan from your previous attempt" in p.messages[-1]["content"]
               for p in batch.prompts)
    # the caller's request object too: the owner saw the rewritten prompts, the caller's stay
    request = GenerationRequest(prompts=list(prompts), n=1, temperature=0.0, top_p=1.0,
                                top_k=0, max_new_tokens=int(run.config.sampling.max_new_tokens))
    mine = request.prompts
    again = run.hook.rlmix_generate(run=run, request=request)
    assert request.prompts is mine and [p.messages[-1]["content"] for p in mine] == before
    assert all("Plan from your previous attempt" in p.messages[-1]["content"]
               for p in again.prompts)
    metrics = loop.train_step(run)  # the training path: rlmix_sample -> rlmix_generate
    assert "sage_abstraction/first_pass_score" in metrics
    assert metrics["reward/mean"] >= 0.75
    assert run.state["sage_abstraction"]["first_rollouts"] == 15  # 5 per call, 3 calls


def test_lm_abstraction(tmp_path):
    run, _, _ = workflow_run(tmp_path, "sage_abstraction.abstract=lm")
    lm = run.resources["sage_abstraction.lm"] = ScriptedLM(
        replies=["- in state start: use `finish`\n\n- nothing else"])
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    batch = run.generate(prompts, n=1)
    assert "state start: called `finish` -> ok (episode over)" in lm.prompts[4]
    assert batch.prompts[0].messages[-1]["content"].endswith(
        "Plan from your previous attempt at this task:\n- in state start: use `finish`\n"
        "- nothing else")


@pytest.mark.parametrize(("override", "key"), [
    ("sage_abstraction.abstract=magic", "sage_abstraction.abstract"),
    ("sage_abstraction.context=full", "sage_abstraction.context"),
    ("sage_abstraction.max_tokens=2", "sage_abstraction.max_tokens")])
def test_settings_errors_name_the_key(override, key):
    with pytest.raises(rlmix.ManifestError, match=key.replace(".", r"\.")):
        make_run({"sage_abstraction": sage}, [override])


def test_example_manifest_runs_and_resumes(tmp_path):
    rows, _ = example_resumes(EXAMPLE, tmp_path / "ex", "sage_abstraction")
    # 2 prompts x 2 training steps, and evaluation's own first passes (it uses the second
    # execution too); the count survives the resume
    assert rows[-1]["sage_abstraction/first_rollouts"] > 4
