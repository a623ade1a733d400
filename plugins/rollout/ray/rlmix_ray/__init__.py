"""Rollout workers as Ray actors: ``rlmix_generate`` split across a pool of workers.

Each worker is a Ray actor that builds its own ``Run`` from the driver's resolved manifest with
the same plugins, by the same names (entry points by name; in-process plugins by their import
path), leaving out itself, trainers, and the names in ``ray.exclude``. A worker loads the policy
itself (``rlmix.loop.load_policy``) and answers ``rlmix_generate`` with its own rollout owner
(``hf`` or whichever the manifest lists before ``ray``).

Weights: after each update the driver puts its state dict in Ray's object store once
(``ray.put``) and sends the reference with every request; a worker whose version is behind loads
it before generating, so every sample carries the version that produced it.

Scoring: with ``ray.score: true`` each worker scores the rows it generated
(``rlmix.loop.score`` with its own copy of the manifest's scorers) and the driver keeps those
terms (score once: ``loop.score`` does not call a scorer whose terms are present), so an
expensive verifier (the ``code`` env's sandbox) runs in parallel across workers.

Faults: a request whose worker died (``RayActorError``) is sent again to a fresh worker that
replaces it, with the same prompts, so the batch is complete; ``ray.max_restarts`` bounds the
replacements per call.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import tempfile
import time
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

import rlmix
from rlmix.types import GenerationRequest, RolloutBatch, Run

NAME = "ray"
# the workers answer rlmix_generate with the manifest's other rollout engine
RLMIX_REQUIRES = {"rlmix_generate": "a rollout engine for its workers, e.g. hf"}
RAY_PIP = "pip install 'ray>=2.9'"


@dataclass
class Settings:
    address: str = "local"  # "local": start a Ray instance here; "auto" or "ray://host:port": join
    workers: int = 2  # rollout actors
    # CPUs reserved per worker; 0 = none (workers share the cores with the trainer, as on one
    # machine, and a leftover worker of an earlier run in the process never starves a new one)
    cpus_per_worker: float = 0.0
    gpus_per_worker: float = 0.0
    num_cpus: int = 0  # CPUs of a local instance; 0 = workers * cpus_per_worker, or all cores
    worker_threads: int = 1  # torch threads in each worker (policy.threads there)
    max_restarts: int = 4  # dead workers replaced per generate call before giving up
    timeout_s: float = 600.0  # one worker's answer; a worker past it is treated as dead
    exclude: list[str] = field(default_factory=list)  # more plugin names workers leave out
    # workers score their rows and the driver keeps the terms; for stateless scorers only
    # (a learned reward head, a judge or counters on the driver would be stale copies there)
    score: bool = False

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers: must be >= 1, got {self.workers}")
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise ValueError("cpus_per_worker / gpus_per_worker: must be >= 0")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if not self.address:
            raise ValueError("address: 'local', 'auto' or a Ray address such as ray://host:10001")


# ---------------------------------------------------------------- plugin specs (pure)


def plugin_spec(name: str, obj: Any, installed_values: dict[str, str]) -> tuple[str, ...]:
    """How a worker rebuilds plugin ``name``: ``("entry", name)`` when it is the installed entry
    point, else the import path of the in-process object (a module, a class, or an instance of
    a class made with no arguments)."""
    value = installed_values.get(name)
    if isinstance(obj, types.ModuleType):
        if value is not None and value.split(":")[0] == obj.__name__ and ":" not in value:
            return ("entry", name)
        return ("module", obj.__name__)
    cls = obj if isinstance(obj, type) else type(obj)
    kind = "class" if isinstance(obj, type) else "instance"
    if value is not None and value == f"{cls.__module__}:{cls.__qualname__}":
        return ("entry", name)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise rlmix.ConfigError(
            f"plugin 'ray': workers cannot import the in-process plugin '{name}' "
            f"({cls.__module__}.{cls.__qualname__}); define it in an importable module")
    return (kind, cls.__module__, cls.__qualname__)


def build_plugin(spec: tuple[str, ...]) -> Any:
    """The object ``plugin_spec`` described (entry points return None: loaded by name)."""
    kind = spec[0]
    if kind == "entry":
        return None
    module = importlib.import_module(spec[1])
    if kind == "module":
        return module
    obj: Any = module
    for part in spec[2].split("."):
        obj = getattr(obj, part)
    return obj if kind == "class" else obj()


def worker_manifest(config: dict[str, Any], keep: list[str], threads: int) -> dict[str, Any]:
    """The driver's resolved manifest for a worker: only the ``keep`` plugins and their blocks,
    no run folder of its own, ``threads`` torch threads."""
    import copy

    cfg = copy.deepcopy(config)
    for name in set(config.get("plugins", [])) - set(keep):
        *parents, leaf = name.split(".")
        node = cfg
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
        if parents and cfg.get(parents[0]) == {}:
            cfg.pop(parents[0])
    cfg["plugins"] = list(keep)
    cfg["out"] = os.path.join(tempfile.gettempdir(), "rlmix-ray-worker")
    policy = dict(cfg.get("policy", {}))
    if threads > 0:
        policy["threads"] = threads
    cfg["policy"] = policy
    log = dict(cfg.get("log", {}))
    log.update({"progress": False, "tensorboard": False, "plot": False})
    cfg["log"] = log
    return cfg


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, non-empty ``[lo, hi)`` shares of ``n`` items over at most ``parts`` workers."""
    spans, lo = [], 0
    for size in [len(p) for p in torch.tensor_split(torch.arange(n), min(parts, n))] if n else []:
        spans.append((lo, lo + size))
        lo += size
    return spans


# ---------------------------------------------------------------- the worker (a Ray actor)


class RolloutWorker:
    """Builds a ``Run`` from the manifest in the actor process and serves ``rlmix_generate``."""

    def __init__(self, config: dict[str, Any], specs: dict[str, tuple[str, ...]],
                 index: int) -> None:
        from omegaconf import OmegaConf

        from rlmix import loop

        extras = {n: build_plugin(s) for n, s in specs.items() if s[0] != "entry"}
        cfg = OmegaConf.create(config)
        self.run, _ = loop.prepare(cfg, extra_plugins=extras, required={})
        loop.load_policy(self.run)
        loop.configure(self.run)
        # the same initial weights as the driver; a different sampling stream per worker
        torch.manual_seed(int(cfg.train.seed) * 1_000_003 + 7919 * (index + 1))
        self.index = index
        self.version = -1

    def where(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "actor": ray.get_runtime_context().get_actor_id(),
                "index": self.index, "plugins": list(self.run.plugin_names)}

    def generate(self, request: dict[str, Any], version: int, weights: list[Any],
                 step: int, score: bool = False) -> RolloutBatch:
        run = self.run
        assert run.policy is not None
        if version > self.version:
            import ray

            state = ray.get(weights[0])
            run.policy.model.load_state_dict(state)
            self.version = version
        run.policy_version = version
        run.step = step
        run.policy.model.eval()
        with torch.no_grad():
            batch = run.hook.rlmix_generate(run=run, request=GenerationRequest(**request))
        if batch is None:
            raise RuntimeError(f"ray worker {self.index}: no plugin among {run.plugin_names} "
                               "returned a batch from rlmix_generate")
        if score:  # the terms travel with the batch; the driver's loop.score keeps them
            from rlmix import loop

            loop.score(run, batch)
        return batch


# ---------------------------------------------------------------- the driver side


@dataclass
class Pool:
    """The driver's view: actors, the manifest they were built from, the weights in the store."""

    settings: Settings
    config: dict[str, Any]
    specs: dict[str, tuple[str, ...]]
    workers: list[Any] = field(default_factory=list)
    started: int = 0  # workers created so far (the next one's index)
    replaced: int = 0
    version: int = -1
    weights: Any = None  # ObjectRef of the state dict at ``version``
    started_ray: bool = False

    def new_worker(self) -> Any:
        import ray

        remote = ray.remote(RolloutWorker).options(
            num_cpus=self.settings.cpus_per_worker, num_gpus=self.settings.gpus_per_worker,
            max_restarts=0)
        actor = remote.remote(self.config, self.specs, self.started)
        self.started += 1
        return actor

    def replace(self, slot: int) -> None:
        import ray

        try:
            ray.kill(self.workers[slot], no_restart=True)
        except Exception:  # already gone
            pass
        self.workers[slot] = self.new_worker()
        self.replaced += 1

    def sync(self, run: Run) -> None:
        """Put the driver's weights in the object store once per policy version."""
        if run.policy_version == self.version and self.weights is not None:
            return
        import ray

        assert run.policy is not None
        state = {k: v.detach().to("cpu", copy=True)
                 for k, v in run.policy.model.state_dict().items()}
        self.weights = ray.put(state)
        self.version = run.policy_version


def start_ray(settings: Settings) -> bool:
    """Connect to Ray (``address``), starting a local instance when asked; True if started."""
    try:
        import ray
    except ImportError:
        raise rlmix.ConfigError(f"plugin 'ray' needs Ray; install it with {RAY_PIP}") from None
    if ray.is_initialized():
        return False
    if settings.address == "local":
        cpus = settings.num_cpus or max(1, int(round(settings.workers *
                                                      settings.cpus_per_worker)))
        if not settings.num_cpus and settings.cpus_per_worker == 0:
            cpus = os.cpu_count() or 1
        # workers import what the driver imports (in-process plugins included)
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        # a local instance listens on loopback only
        ray.init(address="local", include_dashboard=False, num_cpus=cpus,
                 _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
    else:
        ray.init(address=settings.address, log_to_driver=False)
    return True


def _pool(run: Run) -> Pool:
    pool = run.plugin_resources(NAME).get("pool")
    if not isinstance(pool, Pool):
        raise RuntimeError("plugin 'ray' has no worker pool (was rlmix_configure run?)")
    return pool


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    settings: Settings = run.settings(NAME)
    if isinstance(run.plugin_resources(NAME).get("pool"), Pool):
        return
    from omegaconf import OmegaConf

    from rlmix import plugins as plugin_loading

    installed = plugin_loading.installed()
    values = {n: i.value for n, i in installed.items()}
    leave_out = {NAME, *settings.exclude}
    leave_out |= {n for n, i in installed.items() if i.family == "rlmix.trainers"}
    keep = [n for n in run.plugin_names if n not in leave_out]
    specs = {n: plugin_spec(n, run.pm.get_plugin(n), values) for n in keep}
    config = worker_manifest(OmegaConf.to_container(run.config, resolve=True),  # type: ignore[arg-type]
                             keep, settings.worker_threads)
    # the workers of a run that is gone are killed, so that they do not hold the instance's
    # CPUs and leave a later run's actors pending (several runs in one process: tests, notebooks)
    gc.collect()
    started = start_ray(settings)
    pool = Pool(settings=settings, config=config, specs=specs, started_ray=started)
    pool.workers = [pool.new_worker() for _ in range(settings.workers)]
    run.plugin_resources(NAME)["pool"] = pool
    weakref.finalize(run, _kill_workers, pool)


def _kill_workers(pool: Pool) -> None:
    import ray

    if not ray.is_initialized():
        return
    for worker in pool.workers:
        try:
            ray.kill(worker, no_restart=True)
        except Exception:  # already gone, or Ray was shut down
            pass
    pool.workers = []


@rlmix.hookimpl
def rlmix_generate(run: Run, request: GenerationRequest) -> RolloutBatch:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    pool = _pool(run)
    pool.sync(run)
    fields = {"n": request.n, "temperature": request.temperature, "top_p": request.top_p,
              "top_k": request.top_k, "max_new_tokens": request.max_new_tokens}
    spans = split(len(request.prompts), len(pool.workers))

    def submit(i: int) -> Any:
        lo, hi = spans[i]
        worker = pool.workers[i % len(pool.workers)]
        return worker.generate.remote({"prompts": request.prompts[lo:hi], **fields},
                                      pool.version, [pool.weights], run.step,
                                      pool.settings.score)

    pending = {i: submit(i) for i in range(len(spans))}
    parts: list[RolloutBatch | None] = [None] * len(spans)
    restarts = 0
    deadline = {i: time.monotonic() + pool.settings.timeout_s for i in pending}
    while pending:
        ready, _ = ray.wait(list(pending.values()), num_returns=1,
                            timeout=max(0.0, min(deadline.values()) - time.monotonic()))
        done = {i for i, ref in pending.items() if ref in ready}
        late = {i for i in pending if i not in done and time.monotonic() >= deadline[i]}
        for i in done | late:
            ref = pending.pop(i)
            try:
                if i in late:
                    raise GetTimeoutError(f"no answer in {pool.settings.timeout_s} s")
                parts[i] = ray.get(ref)
                deadline.pop(i)
                continue
            except (RayActorError, GetTimeoutError) as exc:
                restarts += 1
                if restarts > pool.settings.max_restarts:
                    raise RuntimeError(
                        f"plugin 'ray': {restarts} rollout workers died in one call (limit "
                        f"ray.max_restarts={pool.settings.max_restarts}); last: {exc}") from exc
                print(f"rlmix: warning: ray worker {i % len(pool.workers)} lost "
                      f"({type(exc).__name__}); replacing it and re-sampling its "
                      f"{spans[i][1] - spans[i][0]} prompts", file=sys.stderr)
                pool.replace(i % len(pool.workers))
                pending[i] = submit(i)
                deadline[i] = time.monotonic() + pool.settings.timeout_s
    batches = [b for b in parts if b is not None]
    pad = run.tokenizer.pad_token_id if run.tokenizer is not None else 0
    return batches[0] if len(batches) == 1 else RolloutBatch.concat(batches, pad or 0)


def shutdown(run: Run) -> None:
    """Kill the run's workers (and the Ray instance the plugin started)."""
    pool = run.plugin_resources(NAME).pop("pool", None)
    if not isinstance(pool, Pool):
        return
    import ray

    _kill_workers(pool)
    if pool.started_ray:
        ray.shutdown()
