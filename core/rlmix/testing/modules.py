"""A toy world for harnesses made of named modules, where each failure can be traced to one
module and rewriting a module that nothing criticised loses what made it work.

Task ``(step, i)`` belongs to family ``(step * prompts_per_step + i) % len(modules)``; family
``j`` is answered right exactly when module ``modules[j]`` holds its key word
(``keys[modules[j]]``). A wrong answer carries the tag of the module that failed
(``no idea [m2]``) and the env's feedback a critique of that module (``m2 should say beta``):
blame is in the trace, and the fix of the blamed module is in its critique.
``module_rewriter`` is a scripted reflection model that follows critiques and, for a module
it must rewrite without one, writes a generic paraphrase that drops the key word: correct text
that nobody asked to change is fragile.

Test fixtures only: nothing here is a shipped default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

import rlmix
from rlmix.types import Prompt, RolloutBatch

KEYS = {"m1": "alpha", "m2": "beta", "m3": "gamma"}
_TASK = re.compile(r"^Task (\d+)\.(\d+)\.")
_PART = re.compile(r"\[(\w+)\] ([^\[]*)")


@dataclass
class ModuleEnv:
    """Prompts ``Task {step}.{i}. [m1] text [m2] text ...``; reward term ``correct``; feedback
    ``info["critique"]`` names the failed module and its key word."""

    keys: dict[str, str] = field(default_factory=lambda: dict(KEYS))

    @property
    def modules(self) -> list[str]:
        return list(self.keys)

    def family(self, run: Any, step: int, i: int) -> str:
        return self.modules[(step * int(run.config.train.prompts_per_step) + i)
                            % len(self.modules)]

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Any, step: int) -> list[Prompt]:
        parts = " ".join(f"[{m}] {run.harness.get(m, '')}" for m in self.modules)
        return [Prompt(messages=[{"role": "user", "content": f"Task {step}.{i}. {parts}"}],
                       answer=f"{step}.{i}", id=f"{step}-{i}",
                       info={"module": self.family(run, step, i)})
                for i in range(int(run.config.train.prompts_per_step))]

    @rlmix.hookimpl
    def rlmix_score(self, run: Any, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        right = []
        for info, text, prompt in zip(batch.info, batch.texts, batch.prompts):
            ok = text == f"ANSWER {prompt.answer}"
            right.append(float(ok))
            module = prompt.info["module"]
            info["critique"] = "" if ok else f"{module} should say {self.keys[module]}"
        return {"correct": torch.tensor(right)}


class ModuleModel:
    """The rollout engine: right when the task's module holds its key word, else
    ``no idea [<module>]``. Counts its rollouts."""

    def __init__(self, env: ModuleEnv) -> None:
        self.env = env
        self.calls = 0

    def answer(self, run: Any, prompt: Prompt) -> str:
        user = prompt.messages[-1]["content"]
        found = _TASK.match(user)
        parts = {k: v.split() for k, v in _PART.findall(user[found.end():])}
        module = prompt.info["module"]
        ok = self.env.keys[module] in parts.get(module, [])
        return f"ANSWER {prompt.answer}" if ok else f"no idea [{module}]"

    @rlmix.hookimpl
    def rlmix_generate(self, run: Any, request: Any) -> RolloutBatch:
        texts = [self.answer(run, p) for p in request.prompts for _ in range(request.n)]
        prompts = [p for p in request.prompts for _ in range(request.n)]
        n = len(texts)
        self.calls += n
        return RolloutBatch(group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
                            tokens=torch.zeros(n, 2, dtype=torch.long),
                            attention_mask=torch.ones(n, 2, dtype=torch.long),
                            completion_mask=torch.tensor([[0.0, 1.0]] * n),
                            behavior_logp=torch.zeros(n, 2),
                            policy_version=torch.zeros(n, dtype=torch.long), texts=texts,
                            prompts=prompts)


_BLOCK = re.compile(r"Module (\w+):\n```\n(.*?)\n```", re.S)
_CRITIQUE = re.compile(r"(\w+) should say (\w+)")


def module_rewriter(prompt: str) -> str:
    """A scripted reflection model: for every ``Module <name>:`` block of the prompt, the
    critiqued word when some critique names that module, else a generic paraphrase of the text
    without its last word (what made it work); answered as blocks in the same order."""
    fixes = dict(_CRITIQUE.findall(prompt))
    out = []
    for name, text in _BLOCK.findall(prompt):
        if name in fixes:
            new = f"use {fixes[name]}"
        else:
            words = text.split()
            new = " ".join(["please", *words[:-1]]) if words else "please"
        out.append(f"Module {name}:\n```\n{new}\n```")
    return "\n".join(out)


def module_plugins(env: ModuleEnv | None = None) -> dict[str, Any]:
    """``{"modenv": env, "modmodel": ModuleModel(env)}`` for ``rlmix.testing.make_run``; the
    metric is ``modenv.correct``."""
    env = env or ModuleEnv()
    return {"modenv": env, "modmodel": ModuleModel(env)}
