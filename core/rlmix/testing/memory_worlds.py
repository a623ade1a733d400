"""Toy worlds for memory, case-retrieval and context plugins: what the model sees decides the
score, and nothing in a world says which memory to show.

* ``CaseEnv`` / ``CaseModel``: tasks of named *families*, each solved by one *procedure* word.
  An *easy* task names its procedure in its own text, so the model solves it unaided; a *hard*
  task does not, and the model solves it only when the harness part of its prompt shows a worked
  case whose ``Solution: USE <procedure>`` is that family's procedure (the model copies the
  first solution it sees). A family's surface words are free, so a world can make one family's
  tasks read like another's: then the most similar past case is the wrong one.
* ``ScriptedAgentEngine``: a multi-turn rollout engine for ``rlmix_episode`` envs driven by a
  scripted agent (``agent(messages) -> text``) instead of a model. It re-sends the whole
  conversation at every model call, as an API agent does, and counts the *input tokens* of each
  call (``Episode.context``, when an episode has it, may rewrite the conversation first).

Test fixtures only: nothing here is a shipped default.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import rlmix
from rlmix.types import Prompt, RolloutBatch

_SOLUTION = re.compile(r"Solution:\s*USE\s+(\w+)")
_NAMED = re.compile(r"\bvia (\w+)\b")


def _rows(n_prompts: int, n: int, texts: list[str], prompts: list[Prompt],
          info: list[dict[str, Any]] | None = None) -> RolloutBatch:
    rows = len(texts)
    return RolloutBatch(group=torch.arange(n_prompts).repeat_interleave(n),
                        tokens=torch.zeros(rows, 2, dtype=torch.long),
                        attention_mask=torch.ones(rows, 2, dtype=torch.long),
                        completion_mask=torch.tensor([[0.0, 1.0]] * rows),
                        behavior_logp=torch.zeros(rows, 2),
                        policy_version=torch.zeros(rows, dtype=torch.long), texts=texts,
                        prompts=prompts, info=info or [])


@dataclass
class Family:
    """One kind of task: ``words`` of its texts, the ``procedure`` that solves it, how often
    (``easy_every``-th task of the family, counting from 0) a task names its procedure, and the
    words of its hard tasks when they read differently (``hard_words``; "" = ``words``)."""

    words: str
    procedure: str
    easy_every: int = 4
    hard_words: str = ""


@dataclass
class CaseEnv:
    """Task ``(step, i)`` is of family ``order[(step * P + i) % len(order)]`` (``P`` prompts per
    step), easy when its running index in that family is a multiple of ``easy_every``. Prompt:
    ``Task: {words} via {procedure}`` when easy, ``Task: {hard_words}`` when hard, then the harness
    ``instructions``; harness ``system`` as a system message. Reward term ``correct``."""

    families: dict[str, Family]
    order: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.order = list(self.order or self.families)

    def task(self, step: int, i: int, per_step: int) -> tuple[str, bool, str]:
        """``(family, easy, text)`` of task ``(step, i)``."""
        k = step * per_step + i
        name = self.order[k % len(self.order)]
        fam = self.families[name]
        easy = (k // len(self.order)) % fam.easy_every == 0
        text = (f"Task: {fam.words} via {fam.procedure}" if easy
                else f"Task: {fam.hard_words or fam.words}")
        return name, easy, text

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Any, step: int) -> list[Prompt]:
        per_step = int(run.config.train.prompts_per_step)
        out = []
        for i in range(per_step):
            name, easy, text = self.task(step, i, per_step)
            user = f"{text}. {run.harness.get('instructions', '')}".strip()
            messages = [{"role": "user", "content": user}]
            if run.harness.get("system"):
                messages.insert(0, {"role": "system", "content": run.harness["system"]})
            out.append(Prompt(messages=messages, answer=self.families[name].procedure,
                              id=f"{step}-{i}", info={"family": name, "easy": easy}))
        return out

    @rlmix.hookimpl
    def rlmix_score(self, run: Any, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        ok = [float(text.strip() == f"USE {p.answer}") for text, p in
              zip(batch.texts, batch.prompts)]
        return {"correct": torch.tensor(ok)}


class CaseModel:
    """A rollout engine for ``CaseEnv``: ``USE <p>`` when the task names its procedure ``p``,
    else the first ``Solution: USE <p>`` shown in the harness part of the prompt, else
    ``no idea``. Counts its rollouts."""

    def __init__(self) -> None:
        self.calls = 0

    @staticmethod
    def answer(prompt: Prompt) -> str:
        user = prompt.messages[-1]["content"]
        task = user.split(". ", 1)[0]
        named = _NAMED.search(task)
        if named:
            return f"USE {named.group(1)}"
        harness = " ".join(m["content"] for m in prompt.messages[:-1]) + " " + user[len(task):]
        shown = _SOLUTION.search(harness)
        return f"USE {shown.group(1)}" if shown else "no idea"

    @rlmix.hookimpl
    def rlmix_generate(self, run: Any, request: Any) -> RolloutBatch:
        texts = [self.answer(p) for p in request.prompts for _ in range(request.n)]
        self.calls += len(texts)
        return _rows(len(request.prompts), request.n, texts,
                     [p for p in request.prompts for _ in range(request.n)])


# ---------------------------------------------------------------- scripted multi-turn agents

Agent = Callable[[list[dict[str, str]]], str]


def count_tokens(messages: Sequence[dict[str, str]], tokenizer: Any = None) -> int:
    """Input tokens of one model call: the tokenizer's tokens of every message's content plus 4
    per message (role and separators), or whitespace words when there is no tokenizer."""
    total = 0
    for m in messages:
        text = str(m["content"])
        total += 4 + (len(tokenizer(text, add_special_tokens=False)["input_ids"])
                      if tokenizer is not None else len(text.split()))
    return total


class ScriptedAgentEngine:
    """``rlmix_generate`` that drives each sample's ``rlmix_episode`` with ``agent`` (a function
    of the conversation so far) for at most ``max_turns`` model calls. Before each call the
    conversation is passed through the episode's optional ``context(messages)`` (an episode may
    drop what it no longer needs) and its input tokens are counted. ``batch.info[i]["episode"]``
    holds ``turns`` (as the ``hf`` engine records them), ``model_text``, ``input_tokens`` (the
    sum over calls), ``calls`` and ``final`` (the agent's last turn). Prompts without an episode
    get one call on their messages."""

    def __init__(self, agent: Agent, max_turns: int = 12, tokenizer: Any = None) -> None:
        self.agent, self.max_turns, self.tokenizer = agent, max_turns, tokenizer
        self.calls = 0  # model calls
        self.episodes = 0  # rollouts (one per sample)
        self.contexts: list[list[dict[str, str]]] = []  # every call's input, in order

    def drive(self, episode: Any, prompt: Prompt) -> dict[str, Any]:
        conversation = list(episode.reset()) if episode is not None else list(prompt.messages)
        turns: list[dict[str, Any]] = []
        tokens = 0
        calls = 0
        text = ""
        for _ in range(self.max_turns):
            shaper = getattr(episode, "context", None)
            seen = list(shaper(list(conversation))) if callable(shaper) else list(conversation)
            self.contexts.append(seen)
            tokens += count_tokens(seen, self.tokenizer)
            calls += 1
            text = self.agent(seen)
            if episode is None:
                turns.append({"assistant": text, "end": "eos"})
                break
            result = episode.step(text)
            turns.append({"assistant": text, "end": "stop", "messages": list(result.messages),
                          "info": dict(result.info)})
            if result.done:
                break
            conversation += [{"role": "assistant", "content": text}, *result.messages]
        self.calls += calls
        self.episodes += 1
        return {"turns": turns, "model_text": "".join(t["assistant"] for t in turns),
                "input_tokens": tokens, "calls": calls, "final": text,
                "stop_reason": "done", "model_tokens": 0, "env_tokens": 0}

    @rlmix.hookimpl
    def rlmix_generate(self, run: Any, request: Any) -> RolloutBatch:
        texts, prompts, info = [], [], []
        for p in request.prompts:
            for _ in range(request.n):
                episode = run.hook.rlmix_episode(run=run, prompt=p)
                record = self.drive(episode, p)
                texts.append(record["model_text"])
                prompts.append(p)
                info.append({"episode": record})
        return _rows(len(request.prompts), request.n, texts, prompts, info)


# ---------------------------------------------------------------- multi-turn workflows

_OFFER = re.compile(r"state: (\w+); actions: ([\w, ]+)")
_CALL = re.compile(r"<tool>\s*(.*?)\s*</tool>", re.S)


@dataclass
class Workflow:
    """A task family's state machine: ``moves[state][action] = next state`` and
    ``broken[state][action] = error message`` (a call the env refuses: the state stays).
    ``offers[state]`` is the order the env lists a state's actions in (default: broken calls
    first, then moves). The episode starts in ``start`` and succeeds on reaching ``done``.
    ``page`` is text every observation carries before its state line, as verbose envs do."""

    moves: dict[str, dict[str, str]]
    broken: dict[str, dict[str, str]] = field(default_factory=dict)
    offers: dict[str, list[str]] = field(default_factory=dict)
    page: str = ""  # text every observation starts with (a page, a listing: verbose envs)

    def offered(self, state: str) -> list[str]:
        if state in self.offers:
            return list(self.offers[state])
        return [*self.broken.get(state, {}), *self.moves.get(state, {})]


class WorkflowEpisode:
    """One task of a ``Workflow``: every observation ends ``state: S; actions: a, b``. A call is
    ``<tool>ACTION</tool>``; a broken call returns ``error: ...`` (``info["error"]``,
    ``info["kind"] = "malformed"``); ``info["state"]`` is the state after the turn."""

    stop_strings = ("</tool>",)

    def __init__(self, prompt: Prompt, flow: Workflow) -> None:
        self.prompt, self.flow, self.state = prompt, flow, "start"

    def observation(self) -> str:
        line = f"state: {self.state}; actions: {', '.join(self.flow.offered(self.state))}"
        return f"{self.flow.page} {line}".strip()

    def reset(self) -> list[dict[str, str]]:
        messages = [dict(m) for m in self.prompt.messages]
        messages[-1]["content"] += f"\n{self.observation()}"
        return messages

    def step(self, assistant_text: str) -> Any:
        from rlmix.types import StepResult

        found = _CALL.search(assistant_text)
        action = found.group(1).strip() if found else ""
        before = self.state
        info: dict[str, Any] = {"action": action, "from": before}
        if action in self.flow.broken.get(before, {}):
            info.update(error=self.flow.broken[before][action], kind="malformed", state=before)
            return StepResult(messages=[{"role": "tool", "content":
                                         f"error: {info['error']}. {self.observation()}"}],
                              info=info)
        if action not in self.flow.moves.get(before, {}):
            info.update(error=f"no action {action!r} here", kind="unknown", state=before)
            return StepResult(messages=[{"role": "tool", "content":
                                         f"error: {info['error']}. {self.observation()}"}],
                              info=info)
        self.state = self.flow.moves[before][action]
        info["state"] = self.state
        if self.state == "done":
            return StepResult(done=True, info=info)
        return StepResult(messages=[{"role": "tool", "content": f"ok. {self.observation()}"}],
                          info=info)


@dataclass
class WorkflowEnv:
    """Task ``(step, i)`` is of workflow ``order[(step * P + i) % len(order)]``; prompt
    ``{name} task {step}.{i}: reach done.`` with the harness ``instructions``, the harness
    ``system`` as a system message; episodes through ``rlmix_episode``. Reward term ``correct``:
    the episode reached ``done``."""

    flows: dict[str, Workflow]
    order: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.order = list(self.order or self.flows)

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Any, step: int) -> list[Prompt]:
        per_step = int(run.config.train.prompts_per_step)
        out = []
        for i in range(per_step):
            name = self.order[(step * per_step + i) % len(self.order)]
            user = f"{name} task {step}.{i}: reach done. {run.harness.get('instructions', '')}"
            messages = [{"role": "system", "content": run.harness.get("system", "")},
                        {"role": "user", "content": user.strip()}]
            out.append(Prompt(messages=messages, answer="done", id=f"{step}-{i}",
                              info={"workflow": name, "state": "start"}))
        return out

    @rlmix.hookimpl
    def rlmix_episode(self, run: Any, prompt: Prompt) -> Any:
        name = prompt.info.get("workflow")
        return WorkflowEpisode(prompt, self.flows[name]) if name in self.flows else None

    @rlmix.hookimpl
    def rlmix_score(self, run: Any, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        ok = []
        for info in batch.info:
            turns = (info.get("episode") or {}).get("turns", [])
            ok.append(float(bool(turns) and turns[-1].get("info", {}).get("state") == "done"))
        return {"correct": torch.tensor(ok)}


def workflow_agent(messages: list[dict[str, str]]) -> str:
    """A scripted agent for ``WorkflowEnv``: in the current state it calls the first offered
    action it has not tried there since arriving, unless its context holds a line
    ``... in state S ... use `R` ...`` or a transcript line ``state S: called `R` -> ok`` for
    the current state ``S`` with ``R`` on offer: then ``R``; a call its context says fails in
    ``S`` (``in state S: `b` fails`` or ``state S: called `b` -> error``) counts as tried. It
    never remembers anything between episodes."""
    state, offered, tried = "", [], []
    for m in messages:
        found = _OFFER.findall(m["content"])
        if found and m["role"] != "assistant":
            new_state, acts = found[-1]
            if new_state != state:  # arrived somewhere new: nothing tried here yet
                tried = []
            state, offered = new_state, [a.strip() for a in acts.split(",")]
        if m["role"] == "assistant":
            call = _CALL.search(m["content"])
            if call:
                tried.append(call.group(1).strip())
    text = "\n".join(m["content"] for m in messages)
    advice = re.findall(rf"in state {re.escape(state)}\b[^\n]*?use `([^`]+)`", text, re.I)
    # a transcript of an earlier attempt: "state S: called `R` -> ok..."
    advice += re.findall(rf"state {re.escape(state)}: called `([^`]+)` -> ok", text, re.I)
    for action in reversed(advice):
        if action in offered:
            return f"<tool>{action}</tool>"
    # calls its context says fail in this state count as tried
    here = re.escape(state)
    tried += re.findall(rf"in state {here}: `([^`]+)` fails", text, re.I)
    tried += re.findall(rf"state {here}: called `([^`]+)` -> error", text, re.I)
    for action in offered:
        if action not in tried:
            return f"<tool>{action}</tool>"
    return f"<tool>{offered[0] if offered else 'stop'}</tool>"


# ---------------------------------------------------------------- a tools agent that re-checks

_COMPUTE = re.compile(r"Compute (.+?)\.(?:\s|$)")
_RESULT = re.compile(r"result: (-?\d+)")


def checking_tool_agent(checks: int = 3, chatter: int = 40) -> Agent:
    """A scripted agent for the ``tools`` env that repeats its calls: it runs the same verbose
    Python program ``checks`` times (a line ``evaluating ...``, ``chatter`` identical progress
    lines, blank lines, then ``result: N``), then answers with the number of the last
    ``result: N`` line it can see in its context (0 when it sees none). Its answer depends on
    the tool's output, so a context that lost the result changes it."""

    def agent(messages: list[dict[str, str]]) -> str:
        user = next((m["content"] for m in messages if m["role"] == "user"), "")
        task = _COMPUTE.search(user)
        expression = task.group(1) if task else "0"
        calls = sum("<tool>python" in m["content"] for m in messages if m["role"] == "assistant")
        if calls < checks:
            program = (f"x = {expression}\nprint('evaluating', {expression!r})\n"
                       f"for _ in range({chatter}):\n    print('working on it...')\n"
                       "print()\nprint()\nprint('result:', x)")
            return f"<tool>python:\n{program}\n</tool>"
        found = [n for m in messages if m["role"] == "tool" for n in _RESULT.findall(m["content"])]
        return f"<answer>{found[-1] if found else 0}</answer>"

    return agent


# ---------------------------------------------------------------- rules learnt from examples

_RULE_TASK = re.compile(r"Convert (-?\d+) using rule (\w+)\.")
_LAST_INT = re.compile(r"-?\d+")


@dataclass
class RuleEnv:
    """Task ``(step, i)``: ``Convert {x} using rule {R}.``, the answer ``x + offsets[R]``; the
    rule is ``rules[(step * P + i) % len(rules)]`` and ``x`` is drawn from ``10..99`` seeded by
    ``(seed, step, i)``. Reward term ``correct``: the reply's last integer is the answer."""

    offsets: dict[str, int]
    seed: int = 0

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Any, step: int) -> list[Prompt]:
        import random

        per_step = int(run.config.train.prompts_per_step)
        names = list(self.offsets)
        out = []
        for i in range(per_step):
            rule = names[(step * per_step + i) % len(names)]
            x = random.Random(f"{self.seed}-{step}-{i}").randint(10, 99)
            out.append(Prompt(messages=[{"role": "user",
                                         "content": f"Convert {x} using rule {rule}."}],
                              answer=x + self.offsets[rule], id=f"{step}-{i}",
                              info={"rule": rule}))
        return out

    @rlmix.hookimpl
    def rlmix_score(self, run: Any, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        ok = []
        for text, p in zip(batch.texts, batch.prompts):
            found = _LAST_INT.findall(text)
            ok.append(float(bool(found) and int(found[-1]) == int(p.answer)))
        return {"correct": torch.tensor(ok)}

    def teacher(self, prompt: str) -> str:
        """A teacher for ``ScriptedLM(reply=...)``: knows every rule."""
        found = _RULE_TASK.findall(prompt)
        if not found:
            return "I cannot tell."
        x, rule = found[-1]
        return f"The answer is {int(x) + self.offsets[rule]}"


class DemoStudent:
    """A rollout engine for ``RuleEnv`` that knows no rule: it infers a rule's offset from a
    demonstration in its context (an earlier user turn ``Convert a using rule R.`` answered
    with a number ``b``: offset ``b - a``) of the same rule as its task, and is then right with
    probability ``skill`` per sample (off by one otherwise); with no such demonstration it
    guesses an offset in ``0..9`` per sample. Sampling is seeded by the prompt and sample."""

    def __init__(self, skill: float = 0.9, seed: int = 0) -> None:
        self.skill, self.seed = skill, seed
        self.calls = 0  # completions generated

    def answer(self, prompt: Prompt, k: int) -> str:
        import random

        rng = random.Random(f"{self.seed}-{prompt.id}-{prompt.messages[-1]['content']}-{k}")
        task = _RULE_TASK.search(prompt.messages[-1]["content"])
        if task is None:
            return "no idea"
        x, rule = int(task.group(1)), task.group(2)
        offset = None
        for m, reply in zip(prompt.messages[:-1], prompt.messages[1:-1]):
            demo = _RULE_TASK.search(m["content"]) if m["role"] == "user" else None
            numbers = _LAST_INT.findall(reply["content"]) if reply["role"] == "assistant" else []
            if demo and numbers and demo.group(2) == rule:
                offset = int(numbers[-1]) - int(demo.group(1))
        if offset is None:
            return f"The answer is {x + rng.randint(0, 9)}"
        slip = 0 if rng.random() < self.skill else rng.choice((-1, 1))
        return f"The answer is {x + offset + slip}"

    @rlmix.hookimpl
    def rlmix_generate(self, run: Any, request: Any) -> RolloutBatch:
        texts = [self.answer(p, k) for p in request.prompts for k in range(request.n)]
        self.calls += len(texts)
        return _rows(len(request.prompts), request.n, texts,
                     [p for p in request.prompts for _ in range(request.n)])
