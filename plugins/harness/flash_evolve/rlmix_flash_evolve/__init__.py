"""FlashEvolve on GEPA: GEPA's stages as asynchronous workers joined by queues.

Synchronous GEPA (``rlmix_gepa.iterate``) runs one proposal at a time: select a parent, run it on
a minibatch, ask the reflection LM for new text, run the child, score an accepted child on the
selection set. While the LM thinks, nothing is evaluated, and while candidates are evaluated,
the LM is idle. FlashEvolve (seed 000, paragraph 36) replaces the synchronised stages with
workers and queues so the stages of different proposals overlap:

* **proposer** (1 thread): reserve the proposal's worst-case metric calls, pick a parent from
  the Pareto front of the pool *as it is now* (its version is stamped on the artifact), run the
  parent on a minibatch and build the reflection prompt from the traces;
* **reflectors** (``reflect_workers`` threads): the LM call;
* **evaluator** (1 thread): apply the staleness policy when the pool moved on since the
  proposal's parent was chosen (``update``, ``discard`` or ``patch``), run the child on the
  minibatch, score an improving child on the selection set, add it to the pool (the version goes
  up), then try a merge as GEPA does.

Every rollout of the task model (and the reflection LM when it is the policy) runs under one
generation lock, which the pipeline holds only while ``rlmix_evolve`` has it open: the loop's
own sampling, updates, evaluation and checkpoints never run beside a worker's generation or its
swap of ``run.harness``. The pool lives in the pipeline; ``run.state["flash_evolve"]`` holds a
snapshot in GEPA's layout, taken whenever the pipeline is closed, so checkpoints are consistent
and a resumed run restarts the pipeline from it (work in flight at the snapshot is dropped; the
calls it had made stay charged). The pure parts (Pareto selection, merge, reflection prompt,
proposal parsing, best candidate) are ``rlmix_gepa``'s.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import queue
import random
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_gepa import Settings as GepaSettings
from rlmix_gepa import (
    best_candidate,
    find_merge,
    parse_proposal,
    reflection_prompt,
    select_parent,
)
from rlmix_harness import (
    GATES,
    Task,
    configure_evolver,
    evolved_components,
    guard_heldout,
    mean,
    reflection_lm,
    score_tasks,
    split_pool,
    traces,
)
from rlmix_lm import LM, PolicyLM, TransformersLM

import rlmix
from rlmix.types import HarnessUpdate, RolloutBatch, Run

NAME = "flash_evolve"
POLICIES = ("update", "discard", "patch")


@dataclass
class Settings(GepaSettings):
    """GEPA's settings (same names, same defaults), plus the pipeline's."""

    staleness: str = "update"  # update | discard | patch: what to do with a stale proposal
    proposals_per_step: int = 1  # mutation proposals decided per rlmix_evolve; 0 = whole budget
    reflect_workers: int = 2  # concurrent reflection-LM calls (not the policy: that has a lock)
    max_inflight: int = 4  # proposals started and not yet decided
    join_timeout_s: float = 30.0  # wait this long for each worker at shutdown

    def __post_init__(self) -> None:
        super().__post_init__()
        rlmix.check_choices(self, staleness=POLICIES)
        if self.proposals_per_step < 0:
            raise ValueError("proposals_per_step: must be >= 0 (0 = the whole budget)")
        if self.reflect_workers < 1:
            raise ValueError("reflect_workers: must be >= 1")
        if self.max_inflight < 1:
            raise ValueError("max_inflight: must be >= 1")
        if self.budget < self.selection_size:
            raise ValueError(f"budget: must cover the seed's evaluation on the selection set "
                             f"({self.selection_size} calls), got {self.budget}")
        if self.join_timeout_s <= 0:
            raise ValueError("join_timeout_s: must be > 0")


class FlashEvolveError(rlmix.RlmixError):
    """A pipeline worker failed; the cause is chained."""


# ---------------------------------------------------------------- budget (thread-safe)


class Budget:
    """Metric calls: ``spent + reserved <= total`` at all times. Work reserves its worst case
    before it starts and charges each evaluation to its reservation *before* running it."""

    def __init__(self, total: int, spent: int = 0) -> None:
        self.total, self.spent, self.reserved = int(total), int(spent), 0
        self.lock = threading.Lock()

    def reserve(self, n: int) -> Reservation | None:
        with self.lock:
            if self.spent + self.reserved + n > self.total:
                return None
            self.reserved += n
            return Reservation(self, n)

    def _charge(self, n: int) -> None:
        with self.lock:
            self.reserved -= n
            self.spent += n

    def _release(self, n: int) -> None:
        with self.lock:
            self.reserved -= n


class Reservation:
    def __init__(self, budget: Budget, n: int) -> None:
        self.budget, self.left, self.charged = budget, n, 0

    def charge(self, n: int) -> None:
        if n > self.left:
            raise RuntimeError(f"flash_evolve: {n} metric calls exceed the {self.left} reserved")
        self.left -= n
        self.charged += n
        self.budget._charge(n)

    def close(self) -> None:
        """Give back what was not charged."""
        left, self.left = self.left, 0
        if left:
            self.budget._release(left)


# ---------------------------------------------------------------- staleness policy (pure)


@dataclass
class StaleDecision:
    """What to evaluate for a proposal: ``child`` texts (None: dropped) and ``base``, a pool
    candidate other than the parent that the child must also beat on the minibatch."""

    action: str  # fresh | update | discard | patch
    child: dict[str, str] | None
    base: int | None = None
    why: str = ""


def resolve_stale(policy: str, stamped_version: int, pool_version: int, parent: int,
                  parent_texts: dict[str, str], best: int, best_texts: dict[str, str],
                  component: str, proposal: str) -> StaleDecision:
    """The staleness policy. A proposal is stale when the pool's version moved past the one it
    was stamped with (a candidate was added after its parent was chosen).

    * fresh: evaluate ``parent + edit`` against the parent, as GEPA does;
    * ``update`` (re-base): evaluate ``parent + edit`` against the current pool: it must beat
      both its parent and the pool's current best on the minibatch;
    * ``discard``: drop it (the calls already spent on the parent stay spent);
    * ``patch``: apply the edit (the proposed text of ``component``) onto the current best when
      the best still has the parent's text of that component (the edit applies cleanly), and
      evaluate that against the best; when it does not apply cleanly, fall back to ``update``.
    When the best is the parent itself, nothing needs re-basing (``base`` is None)."""
    if policy not in POLICIES:
        raise ValueError(f"staleness: {policy!r} is not one of {', '.join(POLICIES)}")
    child = {**parent_texts, component: proposal}
    if pool_version <= stamped_version:
        return StaleDecision("fresh", child)
    behind = f"pool v{pool_version}, proposal based on v{stamped_version}"
    if policy == "discard":
        return StaleDecision("discard", None, why=f"stale ({behind}): discarded")
    base = best if best != parent else None
    if policy == "patch" and base is not None and \
            best_texts.get(component) == parent_texts.get(component):
        return StaleDecision("patch", {**best_texts, component: proposal}, base,
                             f"stale ({behind}): edit patched onto candidate {best}")
    why = (f"stale ({behind}): re-based on candidate {best}" if base is not None
           else f"stale ({behind}): parent is still the best")
    if policy == "patch":
        why += " (patch did not apply cleanly)" if base is not None else ""
    return StaleDecision("update", child, base, why)


def worst_case(settings: Settings, selection: int) -> int:
    """Metric calls a proposal reserves before it starts, as GEPA's iteration: parent and
    child on the minibatch, then an accepted child on the selection set. A stale proposal that
    is re-based reserves one more minibatch when it is decided (or is dropped when that does
    not fit)."""
    return 2 * settings.minibatch_size + selection


# ---------------------------------------------------------------- state (GEPA's layout)


def _tasks(state: dict[str, Any], name: str) -> list[Task]:
    return [(int(a), int(b)) for a, b in state["tasks"][name]]


def _add(state: dict[str, Any], cand: dict[str, str], parents: list[int], origin: str,
         scores: list[float]) -> int:
    state["candidates"].append(dict(cand))
    state["parents"].append(list(parents))
    state["origin"].append(origin)
    state["scores"].append(list(scores))
    state["version"] += 1
    return len(state["candidates"]) - 1


def components(run: Run) -> list[str]:
    return evolved_components(run, NAME)


def new_state(run: Run) -> dict[str, Any]:
    """Tasks and an empty pool, in ``rlmix_gepa``'s layout plus the pipeline's counters."""
    s = run.settings(NAME)
    sets = split_pool(run, {"search": s.search_size, "selection": s.selection_size,
                            "heldout": s.heldout_size}, s.task_step_base)
    return {"components": components(run),
            "tasks": {k: [list(t) for t in v] for k, v in sets.items()},
            "candidates": [], "parents": [], "origin": [], "scores": [], "heldout": {},
            "metric_calls": 0, "heldout_calls": 0, "iteration": 0, "merges": 0,
            "tried_merges": [], "applied": 0, "history": [],
            # the pipeline's own
            "version": 0, "seed_calls": 0, "dropped_calls": 0, "proposals": 0,
            "stale": {"fresh": 0, "update": 0, "discard": 0, "patch": 0}, "open_s": 0.0,
            "finished": False}


def accounted_calls(state: dict[str, Any]) -> int:
    """The calls the state's records explain: the seed's, each decided proposal's and merge's,
    and those of work dropped at a restart. Equals ``metric_calls`` when nothing is in flight."""
    return (state["seed_calls"] + state["dropped_calls"]
            + sum(int(h.get("calls", 0)) for h in state["history"]))


# ---------------------------------------------------------------- the pipeline


class Stopped(Exception):
    """The pipeline is shutting down."""


@dataclass
class Artifact:
    """A proposal on its way through the stages, stamped with the pool version it was based
    on."""

    index: int
    version: int
    parent: int
    parent_texts: dict[str, str]
    component: str
    minibatch: list[Task]
    reservation: Reservation
    extra: Reservation | None = None  # the re-base minibatch of a stale proposal
    parent_scores: list[float] = field(default_factory=list)
    prompt: str = ""
    proposal: str = ""
    started: float = 0.0
    reflected: float = 0.0


class Pipeline:
    """The workers, queues, generation gate and candidate pool of one run."""

    def __init__(self, run: Run, state: dict[str, Any], lm: LM) -> None:
        self.run, self.s = run, run.settings(NAME)
        self.state = state  # mutated only by the evaluator (and the main thread while closed)
        self.lm = lm
        self.lm_locked = isinstance(lm, PolicyLM)  # the policy generates: same lock as rollouts
        # one in-process model serves one generate call at a time (reflectors take turns on
        # it, still beside the task model's rollouts); http and other LMs are called at once
        self.lm_turn = threading.Lock() if isinstance(lm, TransformersLM) else None
        self.budget = Budget(self.s.budget, state["metric_calls"])
        self.pool_lock = threading.Lock()
        self.gen = threading.Lock()
        self.gen.acquire()  # closed: the main thread holds it outside rlmix_evolve
        self.gate = threading.Event()
        self.stop = threading.Event()
        self.cond = threading.Condition()
        self.reflect_q: queue.Queue[Artifact] = queue.Queue()
        self.eval_q: queue.Queue[Artifact] = queue.Queue()
        self.inflight = 0
        self.next_index = int(state["proposals"])
        self.decided = 0
        self.finished = False
        self.error: BaseException | None = None
        self.threads: list[threading.Thread] = []
        self.merge_due = False

    # -- lifecycle

    def start(self) -> Pipeline:
        roles = [("propose", self._propose_loop)]
        roles += [(f"reflect{k}", self._reflect_loop) for k in range(self.s.reflect_workers)]
        roles += [("evaluate", self._evaluate_loop)]
        for role, target in roles:
            t = threading.Thread(target=self._guard, args=(target,), daemon=True,
                                 name=f"flash_evolve-{role}")
            t.start()
            self.threads.append(t)
        atexit.register(self.close)
        return self

    def close(self) -> None:
        """Stop every worker and join it; in-flight work is dropped (its calls stay charged)."""
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        for t in self.threads:
            t.join(self.s.join_timeout_s)
        alive = [t.name for t in self.threads if t.is_alive()]
        atexit.unregister(self.close)
        if alive:
            raise FlashEvolveError(f"flash_evolve: workers did not stop: {', '.join(alive)}")

    def alive(self) -> list[threading.Thread]:
        return [t for t in self.threads if t.is_alive()]

    def _guard(self, target: Any) -> None:
        try:
            target()
        except Stopped:
            pass
        except BaseException as exc:  # reaches the main thread at the next window
            with self.cond:
                self.error = exc
                self.stop.set()
                self.cond.notify_all()

    # -- the generation gate

    @contextlib.contextmanager
    def generation(self) -> Iterator[None]:
        """Hold the generation lock; only possible while the main thread has opened it."""
        while True:
            if self.stop.is_set():
                raise Stopped
            if not self.gate.wait(0.05):
                continue
            if self.gen.acquire(timeout=0.05):
                if self.gate.is_set() and not self.stop.is_set():
                    break
                self.gen.release()
        try:
            yield
        finally:
            self.gen.release()

    def window(self, target: int) -> float:
        """Open the gate until ``target`` more proposals are decided (0: until the budget is
        spent), then close it (waiting for a worker's generation in progress). Seconds open."""
        t0 = time.perf_counter()
        start = self.decided
        self.gate.set()
        self.gen.release()
        try:
            with self.cond:
                while not (self.error or self.finished or self.stop.is_set()
                           or (target and self.decided - start >= target)):
                    self.cond.wait(0.05)
        finally:
            self.gate.clear()
            self.gen.acquire()
        if self.error is not None:
            raise FlashEvolveError(f"flash_evolve: a pipeline worker failed: "
                                   f"{self.error!r}") from self.error
        return time.perf_counter() - t0

    def snapshot(self) -> dict[str, Any]:
        with self.pool_lock:
            state = copy.deepcopy(self.state)
        state["metric_calls"] = self.budget.spent
        state["proposals"] = self.next_index
        state["finished"] = self.finished
        return state

    # -- evaluation

    def evaluate(self, texts: dict[str, str], tasks: Sequence[Task], reservation: Reservation
                 ) -> tuple[list[float], RolloutBatch]:
        """Score ``texts`` on ``tasks`` under the generation lock; charged before it runs."""
        with self.generation():
            reservation.charge(len(tasks))
            return score_tasks(self.run, texts, tasks, temperature=self.s.temperature,
                               max_new_tokens=self.s.max_new_tokens or None,
                               metric=self.s.metric, owner=NAME)

    # -- stages

    def _propose_loop(self) -> None:
        selection = len(_tasks(self.state, "selection"))
        worst = worst_case(self.s, selection)
        while not self.stop.is_set():
            with self.cond:
                if self.inflight >= self.s.max_inflight:
                    self.cond.wait(0.05)
                    continue
                reservation = self.budget.reserve(worst)
                if reservation is None:
                    if self.inflight == 0:  # nothing left that could give calls back
                        self.finished = True
                        self.cond.notify_all()
                        return
                    self.cond.wait(0.05)
                    continue
                self.inflight += 1
                index = self.next_index
                self.next_index += 1
            try:
                self.reflect_q.put(self._start(index, reservation))
            except Stopped:
                reservation.close()
                raise

    def _start(self, index: int, reservation: Reservation) -> Artifact:
        s = self.s
        started = time.perf_counter()
        rng = random.Random(f"{NAME}-{s.seed}-{index}")
        with self.pool_lock:
            version = self.state["version"]
            parent = select_parent(self.state["scores"], rng)
            parent_texts = dict(self.state["candidates"][parent])
            search = _tasks(self.state, "search")
            names = list(self.state["components"])
        first = (index * s.minibatch_size) % len(search)
        minibatch = [search[(first + k) % len(search)] for k in range(s.minibatch_size)]
        component = names[index % len(names)]  # round-robin over components
        art = Artifact(index, version, parent, parent_texts, component, minibatch, reservation,
                       started=started)
        art.parent_scores, batch = self.evaluate(parent_texts, minibatch, reservation)
        art.prompt = reflection_prompt(component, parent_texts[component],
                                       traces(batch, art.parent_scores, s.feedback_chars))
        return art

    def _reflect_loop(self) -> None:
        s = self.s
        while not self.stop.is_set():
            try:
                art = self.reflect_q.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                with self.generation() if self.lm_locked else contextlib.nullcontext(), \
                        self.lm_turn or contextlib.nullcontext():
                    reply = self.lm.complete(art.prompt, s.lm.max_new_tokens, s.lm.temperature)
            except Stopped:
                art.reservation.close()
                raise
            art.proposal = parse_proposal(reply)
            art.reflected = time.perf_counter()
            self.eval_q.put(art)

    def _evaluate_loop(self) -> None:
        while not self.stop.is_set():
            try:
                art = self.eval_q.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                record = self._decide(art)
            finally:
                art.reservation.close()
                if art.extra is not None:
                    art.extra.close()
            self._record(record, art.reservation.charged
                         + (art.extra.charged if art.extra is not None else 0))
            if record.get("accepted") and self.s.merge:
                self._try_merge(art.index)
            with self.cond:
                self.inflight -= 1
                self.decided += 1
                self.cond.notify_all()

    def _record(self, record: dict[str, Any], calls: int) -> None:
        with self.pool_lock:
            record["calls"] = calls
            record["iteration"] = self.state["iteration"]
            record["metric_calls"] = self.budget.spent
            self.state["history"].append(record)
            self.state["iteration"] += 1

    def _decide(self, art: Artifact) -> dict[str, Any]:
        with self.pool_lock:
            state = self.state
            version = state["version"]
            best = best_candidate(state)
            best_texts = dict(state["candidates"][best])
            selection = _tasks(state, "selection")
        record: dict[str, Any] = {
            "kind": "mutation", "index": art.index, "parent": art.parent,
            "component": art.component, "version": art.version, "pool_version": version,
            "proposal": art.proposal, "parent_minibatch": sum(art.parent_scores),
            "reflect_s": art.reflected - art.started}
        if not art.proposal or art.proposal == art.parent_texts[art.component]:
            record["accepted"], record["why"] = False, "no new text proposed"
            return record
        d = resolve_stale(self.s.staleness, art.version, version, art.parent, art.parent_texts,
                          best, best_texts, art.component, art.proposal)
        record["staleness"] = d.action
        with self.pool_lock:
            self.state["stale"][d.action] += 1
        if d.why:
            record["stale_why"] = d.why
        if d.child is None:
            record["accepted"], record["why"] = False, d.why
            return record
        if d.child == best_texts or d.child == art.parent_texts:
            record["accepted"], record["why"] = False, "no new text proposed"
            return record
        if d.base is not None:
            art.extra = self.budget.reserve(self.s.minibatch_size)
            if art.extra is None:
                record["accepted"] = False
                record["why"] = f"{d.why}; no budget left to re-base it: dropped"
                return record
        c_scores, _ = self.evaluate(d.child, art.minibatch, art.reservation)
        record["child_minibatch"] = sum(c_scores)
        bar = sum(art.parent_scores) if d.action != "patch" else float("-inf")
        if d.base is not None:
            b_scores, _ = self.evaluate(best_texts, art.minibatch, art.extra)
            record["base"], record["base_minibatch"] = d.base, sum(b_scores)
            bar = max(bar, sum(b_scores))
        if not sum(c_scores) > bar:
            record["accepted"], record["why"] = False, "minibatch score did not improve"
            return record
        full, _ = self.evaluate(d.child, selection, art.reservation)
        reference = d.base if d.base is not None else art.parent
        ok, why = self._gate(reference, full)
        record["selection"] = mean(full)
        if not ok:
            record["accepted"], record["why"] = False, f"flip gate: {why}"
            return record
        parents = [art.parent] if d.action != "patch" else [d.base]
        with self.pool_lock:
            record["child"] = _add(self.state, d.child, parents, "mutation", full)
        record["accepted"] = True
        return record

    def _gate(self, reference: int, child_scores: list[float]) -> tuple[bool, str]:
        gates = self.run.resources.get(GATES)
        if gates is None:
            return True, ""
        with self.pool_lock:
            before = list(self.state["scores"][reference])
        result = gates.check(before, child_scores)
        return result.passed, result.reason

    def _try_merge(self, index: int) -> None:
        """GEPA's merge after an accepted mutation, at most ``max_merges`` in the run."""
        s = self.s
        with self.pool_lock:
            state = self.state
            if state["merges"] >= s.max_merges:
                return
            selection = _tasks(state, "selection")
            tried = {tuple(t) for t in state["tried_merges"]}
            rng = random.Random(f"{NAME}-merge-{s.seed}-{index}")
            found = find_merge(state["candidates"], state["parents"], state["scores"], tried,
                               rng)
            if found is None:
                return
            reservation = self.budget.reserve(s.minibatch_size + len(selection))
            if reservation is None:
                return
            i, j, a, merged = found
            state["tried_merges"].append([i, j, a])
            state["merges"] += 1
            si, sj = list(state["scores"][i]), list(state["scores"][j])
        record: dict[str, Any] = {"kind": "merge", "parents": [i, j], "ancestor": a}
        try:
            differ = [k for k in range(len(selection)) if si[k] != sj[k]] or \
                list(range(len(selection)))
            rng.shuffle(differ)
            pick = sorted(differ[:s.minibatch_size])
            m_scores, _ = self.evaluate(merged, [selection[k] for k in pick], reservation)
            record["merge_minibatch"] = sum(m_scores)
            if sum(m_scores) < max(sum(si[k] for k in pick), sum(sj[k] for k in pick)):
                record["accepted"], record["why"] = False, "worse than a parent on the subsample"
            else:
                full, _ = self.evaluate(merged, selection, reservation)
                ok, why = self._gate(i if mean(si) >= mean(sj) else j, full)
                record["selection"] = mean(full)
                if ok:
                    with self.pool_lock:
                        record["child"] = _add(self.state, merged, [i, j], "merge", full)
                    record["accepted"] = True
                else:
                    record["accepted"], record["why"] = False, f"flip gate: {why}"
        finally:
            reservation.close()
        self._record(record, reservation.charged)


# ---------------------------------------------------------------- the run's pipeline


def _lm(run: Run) -> LM:
    return reflection_lm(run, NAME)


def pipeline(run: Run) -> Pipeline:
    """The run's pipeline, started from ``run.state["flash_evolve"]`` (seeded first if the run
    has no state yet); called with the generation gate closed (from the main thread)."""
    pipe = run.plugin_resources(NAME).get("pipeline")
    if pipe is not None:
        return pipe
    state = copy.deepcopy(run.state.get(NAME)) or new_state(run)
    if not state["candidates"]:  # the seed, scored on the selection set (counted)
        s = run.settings(NAME)
        budget = Budget(s.budget, state["metric_calls"])
        reservation = budget.reserve(len(_tasks(state, "selection")))
        if reservation is None:
            raise rlmix.ConfigError(f"flash_evolve.budget: {s.budget} metric calls cannot "
                                    f"score the seed on the selection set")
        seed = {c: run.harness[c] for c in state["components"]}
        scores, _ = score_tasks(run, seed, _tasks(state, "selection"),
                                temperature=s.temperature,
                                max_new_tokens=s.max_new_tokens or None, metric=s.metric,
                                owner=NAME)
        reservation.charge(len(scores))
        state["metric_calls"] = budget.spent
        state["seed_calls"] = len(scores)
        _add(state, seed, [], "seed", scores)
        state["version"] = 0
    else:  # a restart: work that was in flight at the snapshot is gone, its calls stay spent
        state["dropped_calls"] += state["metric_calls"] - accounted_calls(state)
    run.state[NAME] = copy.deepcopy(state)
    _score_heldout(run, state, 0)
    pipe = run.plugin_resources(NAME)["pipeline"] = Pipeline(run, state, _lm(run)).start()
    return pipe


def close(run: Run) -> None:
    """Stop and join the run's pipeline (if any) and keep its last snapshot in ``run.state``."""
    pipe = run.plugin_resources(NAME).pop("pipeline", None)
    if pipe is None:
        return
    try:
        pipe.close()
    finally:
        if pipe.error is None:
            _publish(run, pipe)


def _publish(run: Run, pipe: Pipeline) -> None:
    state = pipe.snapshot()
    run.state[NAME] = state


def _score_heldout(run: Run, state: dict[str, Any], c: int) -> None:
    """Held-out score of candidate ``c`` (reporting, not counted against the budget); main
    thread, gate closed."""
    s = run.settings(NAME)
    tasks = _tasks(state, "heldout")
    if not tasks or str(c) in state["heldout"]:
        return
    guard_heldout(run, tasks)
    scores, _ = score_tasks(run, state["candidates"][c], tasks, temperature=s.temperature,
                            max_new_tokens=s.max_new_tokens or None, metric=s.metric, owner=NAME)
    state["heldout_calls"] += len(tasks)
    state["heldout"][str(c)] = mean(scores)


def evolve(run: Run, proposals: int | None = None) -> HarnessUpdate | None:
    """Open the pipeline until ``proposals`` more proposals are decided (default
    ``proposals_per_step``; 0 = until the budget is spent), close it, and return the harness
    update when the best candidate changed."""
    s = run.settings(NAME)
    if NAME not in run.state and not components(run):
        return None
    if run.state.get(NAME, {}).get("finished") and "pipeline" not in run.plugin_resources(NAME):
        return None  # the budget was spent: nothing more fits
    pipe = pipeline(run)
    if pipe.error is not None:
        close(run)
        raise FlashEvolveError(f"flash_evolve: a pipeline worker failed: "
                               f"{pipe.error!r}") from pipe.error
    target = s.proposals_per_step if proposals is None else proposals
    if not pipe.finished and not pipe.stop.is_set():
        opened = pipe.window(target)
        with pipe.pool_lock:
            pipe.state["open_s"] += opened
    state = pipe.snapshot()
    best = best_candidate(state)
    if best != state["applied"]:
        state["applied"] = best
        _score_heldout(run, state, best)
        with pipe.pool_lock:  # keep what the main thread added
            pipe.state["applied"] = best
            pipe.state["heldout"] = dict(state["heldout"])
            pipe.state["heldout_calls"] = state["heldout_calls"]
        update = HarnessUpdate(
            components=dict(state["candidates"][best]),
            evidence=(f"candidate {best} ({state['origin'][best]} of {state['parents'][best]}):"
                      f" selection mean {mean(state['scores'][best]):.3f} over "
                      f"{len(state['scores'][best])} tasks (seed {mean(state['scores'][0]):.3f});"
                      f" {state['metric_calls']} metric calls, {state['proposals']} proposals"),
            parent_version=run.harness_version, source=NAME)
    else:
        update = None
    run.state[NAME] = state
    if pipe.finished:
        close(run)
    return update


# ---------------------------------------------------------------- hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    configure_evolver(run, NAME)


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return evolve(run)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    pipe = run.plugin_resources(NAME).get("pipeline")
    if pipe is not None and run.step >= int(run.config.train.steps):
        close(run)  # the run's last step: no worker outlives it
    state = run.state.get(NAME)
    if not state or not state["candidates"]:
        return
    best = state["applied"]
    decided = [h for h in state["history"] if h["kind"] == "mutation"]
    metrics[f"{NAME}/metric_calls"] = state["metric_calls"]
    metrics[f"{NAME}/candidates"] = len(state["candidates"])
    metrics[f"{NAME}/best"] = best
    metrics[f"{NAME}/best_selection"] = mean(state["scores"][best])
    metrics[f"{NAME}/seed_selection"] = mean(state["scores"][0])
    metrics[f"{NAME}/proposals"] = len(decided)
    metrics[f"{NAME}/stale"] = sum(v for k, v in state["stale"].items() if k != "fresh")
    for k in ("update", "discard", "patch"):
        metrics[f"{NAME}/stale_{k}"] = state["stale"][k]
    if state["open_s"] > 0:
        metrics[f"{NAME}/proposals_per_s"] = len(decided) / state["open_s"]
    if str(best) in state["heldout"]:
        metrics[f"{NAME}/heldout"] = state["heldout"][str(best)]
        metrics[f"{NAME}/seed_heldout"] = state["heldout"]["0"]


@rlmix.hookimpl
def rlmix_run_end(run: Run) -> None:
    # the run ended (normally, or by an exception mid-step): no worker outlives it
    try:
        close(run)
    except FlashEvolveError as err:  # run_end must not raise; say what was left behind
        print(f"rlmix: warning: {err}")
