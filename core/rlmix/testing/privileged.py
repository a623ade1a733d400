"""A prompt-conditioned toy policy and its world, where a privileged view shifts the logits.

``PrivilegedToyPolicy`` is a table of logits per prompt and completion position
(``[P, L, V]``). A *view* is a marker string and a fixed logit shift ``[P, L, V]``: when a
prompt's messages contain the marker (the answer, a reference solution, a context appended to
the question), the shift is added to the same table. Teacher and student therefore share their
weights and differ only in the prompt, as in on-policy self-distillation, and the teacher
moves when the student does.

``PrivilegedToyWorld`` is a plugin object around it: env (``rlmix_prompts``,
``rlmix_score``: exact match of the completion with the prompt's answer tokens), rollout engine
(``rlmix_generate``: samples under each prompt's own messages) and logit server
(``rlmix_completion_logits``, the ``rlmix.distill`` seam). The policy also has the
``Policy`` methods the loop uses (``model``, ``logprobs``), so ``toy_world_run`` builds a
``Run`` on which ``rlmix.loop.train_step`` runs the real step, scoring, advantage owner,
``rlmix_clip`` owner and wrappers, and the core's AdamW, in milliseconds a step.

A prompt whose ``info["continue_from"]`` holds token ids is continued from them (the engine
keeps them as the completion's first tokens and samples the rest): the continuation probe a
step-level credit method needs.

Exact metrics come from the table, not from samples: ``sampled_accuracy`` (the probability
that a temperature-1 sample is the answer), ``pass_at`` (``1 - (1 - p)^k``) and
``greedy_accuracy``.
"""

from __future__ import annotations

from typing import Any

import torch

import rlmix
from rlmix.sampling import continuation_prefix
from rlmix.types import GenerationRequest, Prompt, RolloutBatch, Run

Messages = list[dict[str, str]]


def messages_text(messages: Messages) -> str:
    return "\n".join(str(m.get("content", "")) for m in messages)


class PrivilegedToyPolicy(torch.nn.Module):
    """``logits[p, t]``: the student's distribution at completion position ``t`` of prompt
    ``p``; ``views[marker]`` a fixed shift added when the prompt's text contains ``marker``."""

    def __init__(self, n_prompts: int, length: int, vocab: int,
                 init: torch.Tensor | None = None,
                 views: dict[str, torch.Tensor] | None = None, seed: int = 0) -> None:
        super().__init__()
        self.n_prompts, self.length, self.vocab = n_prompts, length, vocab
        start = torch.zeros(n_prompts, length, vocab) if init is None else init.clone().float()
        if tuple(start.shape) != (n_prompts, length, vocab):
            raise ValueError(f"init has shape {tuple(start.shape)}, expected "
                             f"{(n_prompts, length, vocab)}")
        self.logits = torch.nn.Parameter(start)
        self.views = {k: v.float() for k, v in (views or {}).items()}
        self.generator = torch.Generator().manual_seed(seed)
        # the Policy attributes the loop touches (``model`` is a property: itself)
        self.tokenizer = None
        self.device = torch.device("cpu")

    @property
    def model(self) -> PrivilegedToyPolicy:
        return self

    def shift(self, index: int, messages: Messages) -> torch.Tensor:
        """The summed shift ``[L, V]`` of every view whose marker is in ``messages``."""
        text = messages_text(messages)
        out = torch.zeros(self.length, self.vocab)
        for marker, shift in self.views.items():
            if marker in text:
                out = out + shift[index]
        return out

    def table(self, indices: list[int], messages: list[Messages]) -> torch.Tensor:
        """Logits ``[n, L, V]`` of each row's prompt under its messages (with gradient)."""
        shifts = torch.stack([self.shift(i, m) for i, m in zip(indices, messages, strict=True)])
        return self.logits[torch.tensor(indices, dtype=torch.long)] + shifts

    def logprobs(self, run: Run, batch: RolloutBatch,
                 model: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logp, entropy)`` ``[n, L + 1]`` under each row's own prompt, as ``Policy``."""
        indices = [prompt_index(p) for p in batch.prompts]
        logp_table = torch.log_softmax(self.table(indices, [p.messages for p in batch.prompts]),
                                       -1)
        logp = logp_table.gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
        entropy = -(logp_table.exp() * logp_table).sum(-1)
        zero = torch.zeros(len(batch), 1)
        return (torch.cat([zero, logp], 1) * batch.completion_mask,
                torch.cat([zero, entropy], 1) * batch.completion_mask)

    def autocast(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    # exact metrics, from the table
    @torch.no_grad()
    def answer_prob(self, answers: torch.Tensor, indices: list[int] | None = None,
                    messages: list[Messages] | None = None) -> torch.Tensor:
        """Per prompt, the probability that a temperature-1 sample is exactly the answer."""
        indices = list(range(self.n_prompts)) if indices is None else indices
        messages = messages or [[] for _ in indices]
        probs = torch.softmax(self.table(indices, messages), -1)
        picked = probs.gather(-1, answers[torch.tensor(indices)][..., None]).squeeze(-1)
        return picked.prod(-1)

    @torch.no_grad()
    def greedy_correct(self, answers: torch.Tensor, indices: list[int] | None = None
                       ) -> torch.Tensor:
        indices = list(range(self.n_prompts)) if indices is None else indices
        argmax = self.table(indices, [[] for _ in indices]).argmax(-1)
        return (argmax == answers[torch.tensor(indices)]).all(-1).float()


def prompt_index(prompt: Prompt) -> int:
    return int(prompt.info["index"])


class PrivilegedToyWorld:
    """Env, rollout engine and logit server of a ``PrivilegedToyPolicy`` (register it as a
    plugin, e.g. under the name ``toyworld``). ``answers[p]`` is prompt ``p``'s answer
    (``[P, L]`` token ids); ``info[p]`` extra ``Prompt.info`` (a reference solution, views).
    Prompts are dealt round-robin, ``train.prompts_per_step`` a step; ``subset`` restricts
    them."""

    def __init__(self, policy: PrivilegedToyPolicy, answers: torch.Tensor,
                 info: dict[int, dict[str, Any]] | None = None,
                 subset: list[int] | None = None) -> None:
        self.policy = policy
        self.answers = answers.long()
        self.info = info or {}
        self.subset = list(range(policy.n_prompts)) if subset is None else list(subset)
        self.generated_rows = 0  # every row rlmix_generate produced (the rollout budget)

    def prompt(self, index: int) -> Prompt:
        answer = " ".join(str(int(t)) for t in self.answers[index])
        return Prompt(messages=[{"role": "user", "content": f"task {index}"}], answer=answer,
                      id=str(index), info={"index": index, **self.info.get(index, {})})

    def correct(self, batch: RolloutBatch) -> torch.Tensor:
        answers = self.answers[torch.tensor([prompt_index(p) for p in batch.prompts])]
        return (batch.tokens[:, 1:] == answers).all(-1).float()

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Run, step: int) -> list[Prompt]:
        k = int(run.config.train.prompts_per_step)
        return [self.prompt(self.subset[(step * k + j) % len(self.subset)]) for j in range(k)]

    @rlmix.hookimpl
    def rlmix_generate(self, run: Run, request: GenerationRequest) -> RolloutBatch:
        pol = self.policy
        rows, prompts, group = [], [], []
        with torch.no_grad():
            for g, prompt in enumerate(request.prompts):
                logits = pol.table([prompt_index(prompt)], [prompt.messages])[0]
                if request.temperature <= 0:
                    draws = logits.argmax(-1).expand(request.n, -1).clone()
                else:
                    probs = torch.softmax(logits / request.temperature, -1)
                    draws = torch.multinomial(probs, request.n, replacement=True,
                                              generator=pol.generator).T.clone()
                # a continuation: the first tokens are given (Prompt.info["continue_from"])
                prefix = continuation_prefix(prompt)[:pol.length]
                if prefix:
                    draws[:, :len(prefix)] = torch.tensor(prefix)
                rows.append(draws)
                prompts += [prompt] * request.n
                group += [g] * request.n
        draws = torch.cat(rows)
        n = len(draws)
        self.generated_rows += n
        tokens = torch.cat([torch.tensor([[prompt_index(p)] for p in prompts]), draws], 1)
        cmask = torch.cat([torch.zeros(n, 1), torch.ones(n, pol.length)], 1)
        batch = RolloutBatch(group=torch.tensor(group), tokens=tokens,
                             attention_mask=torch.ones_like(tokens), completion_mask=cmask,
                             behavior_logp=torch.zeros(n, pol.length + 1),
                             policy_version=torch.full((n,), run.policy_version),
                             texts=[" ".join(map(str, r.tolist())) for r in draws],
                             prompts=prompts)
        with torch.no_grad():
            batch.behavior_logp = pol.logprobs(run, batch)[0]
        return batch

    @rlmix.hookimpl
    def rlmix_score(self, run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        return {"correct": self.correct(batch)}

    @rlmix.hookimpl
    def rlmix_completion_logits(self, run: Run, batch: RolloutBatch,
                                messages: list[Messages] | None) -> torch.Tensor:
        messages = [p.messages for p in batch.prompts] if messages is None else messages
        return self.policy.table([prompt_index(p) for p in batch.prompts], messages)


def toy_world_run(world: PrivilegedToyWorld, plugins: dict[str, Any],
                  overrides: list[str] | None = None, scorer: bool = True,
                  optimizer: str = "adamw") -> Run:
    """A ``Run`` of ``world`` (registered first, as ``toyworld``) and ``plugins`` (in order),
    with the toy as the policy and the core's AdamW configured. ``scorer=False`` registers the
    world without its ``rlmix_score`` (a reward-free run). ``optimizer="sgd"`` swaps in plain
    SGD at ``train.lr`` (the core's update steps whatever ``run.optimizer`` is): on a table,
    Adam's per-entry normalisation cancels a constant per-token weight, SGD keeps it, so claims
    about token weighting use SGD. Train it with ``rlmix.loop.train_step``."""
    from rlmix import loop
    from rlmix.testing import make_run

    env = world if scorer else _WithoutScorer(world)
    run = make_run({"toyworld": env, **plugins},
                   ["train.lr=0.1", "train.max_grad_norm=0", "train.prompts_per_step=4",
                    "train.group_size=8", "train.checkpoint_every=0", *(overrides or [])])
    run.policy = world.policy  # type: ignore[assignment]
    loop.configure(run)
    if optimizer == "sgd":
        run.optimizer = torch.optim.SGD(world.policy.parameters(), lr=float(run.config.train.lr))
    elif optimizer != "adamw":
        raise ValueError(f"optimizer: {optimizer!r} is not adamw or sgd")
    return run


class _WithoutScorer:
    """``world`` without ``rlmix_score``."""

    def __init__(self, world: PrivilegedToyWorld) -> None:
        self.world = world

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Run, step: int) -> list[Prompt]:
        return self.world.rlmix_prompts(run, step)

    @rlmix.hookimpl
    def rlmix_generate(self, run: Run, request: GenerationRequest) -> RolloutBatch:
        return self.world.rlmix_generate(run, request)

    @rlmix.hookimpl
    def rlmix_completion_logits(self, run: Run, batch: RolloutBatch,
                                messages: list[Messages] | None) -> torch.Tensor:
        return self.world.rlmix_completion_logits(run, batch, messages)
