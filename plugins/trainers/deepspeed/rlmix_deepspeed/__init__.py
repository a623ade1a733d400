"""``rlmix_update`` through DeepSpeed ZeRO (stages 0-3), in one process or several.

The core computes each minibatch's loss already divided by the whole optimizer step's
normalisers and marks the minibatch that closes the step (``loss.minibatch.last``). DeepSpeed
must therefore neither rescale by the accumulation count nor decide the boundary itself: the
engine runs with ``gradient_accumulation_steps: 1`` and ``managed_gradient_accumulation:
false``, ``backward(..., scale_wrt_gas=False)`` on every minibatch, and ``step()`` only on the
last one, so the step's gradient is exactly the core default's.

Several processes (``torchrun --nproc_per_node K -m rlmix run m.yaml``): every rank draws the
same prompts (``rlmix_prompts`` is deterministic in the step); each rank samples its contiguous
share (its ``rlmix_select_prompts``, run last, returns it) and the shares are all-gathered, so
every rank holds the whole batch for scoring and advantages (group statistics need whole
groups). Each rank then trains on its share of the rows (``run.shard``: ``Run.minibatches``);
the normalisers are summed over ranks before the loss is aggregated and the loss is multiplied by
the world size (DeepSpeed averages gradients over data-parallel ranks), so the gradient equals
the one-process gradient of the whole batch. ``shard: false`` instead has rank 0's batch
broadcast and every rank train on all of it (no data parallelism, only ZeRO's memory split).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import rlmix
from rlmix.types import LossTerms, Minibatch, Prompt, RolloutBatch, Run

NAME = "deepspeed"
DS_PIP = "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8"
COMPLETE = "rlmix-complete"  # written last into a DeepSpeed checkpoint tag folder


@dataclass
class Settings:
    stage: int = 2  # ZeRO stage: 0 (plain data parallel), 1, 2 or 3
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer state on the CPU (DeepSpeedCPUAdam)
    offload_params: bool = False  # ZeRO-3 only: parameters on the CPU between uses
    bf16: bool = False  # bf16 weights and gradients with fp32 master weights in the optimizer
    backend: str = "auto"  # torch.distributed backend: auto (nccl on CUDA, gloo on CPU), ...
    shard: bool = True  # several ranks: each samples and trains its share (data parallel)
    save_hf: bool = True  # checkpoint steps: consolidated fp32 weights, a from_pretrained folder
    shm_comm: bool = False  # CPU only: DeepSpeed's shared-memory allreduce (compiles once, ~2 min)
    config: dict[str, Any] = field(default_factory=dict)  # raw DeepSpeed config, merged last

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage: {self.stage!r} is not a ZeRO stage; choose 0, 1, 2 or 3")
        rlmix.check_choices(self, backend=("auto", "gloo", "nccl", "ccl"))
        if self.offload_params and self.stage != 3:
            raise ValueError("offload_params: parameter offload needs stage: 3")
        if self.offload_optimizer and self.stage == 0:
            raise ValueError("offload_optimizer: optimizer offload needs stage 1, 2 or 3")


@dataclass
class Trainer:
    """What the plugin keeps in ``run.plugin_resources("deepspeed")["trainer"]``."""

    engine: Any
    settings: Settings
    rank: int
    world: int
    root: Path  # the run folder shared by all ranks (rank > 0 logs under root/ranks/rank-N)
    device: torch.device
    resume_checked: bool = False

    @property
    def data_parallel(self) -> bool:
        return self.world > 1 and self.settings.shard


# ---------------------------------------------------------------- pure pieces


def ds_config(settings: Settings, train: Any) -> dict[str, Any]:
    """The DeepSpeed config for ``settings`` and the manifest's ``train`` block."""
    zero: dict[str, Any] = {"stage": settings.stage, "overlap_comm": False}
    if settings.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if settings.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    max_norm = float(train.max_grad_norm)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        # the core divides by whole-update normalisers and marks the boundary: DeepSpeed must not
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max_norm if max_norm > 0 else 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if settings.bf16:
        cfg["bf16"] = {"enabled": True, "check_grad_overflow": True}
    if settings.offload_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": adamw_params(train)}
    return merge(cfg, settings.config)


def adamw_params(train: Any) -> dict[str, Any]:
    return {"lr": float(train.lr), "betas": [float(train.adam_beta1), float(train.adam_beta2)],
            "eps": 1e-8, "weight_decay": float(train.weight_decay)}


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` merged into a copy of ``base``, nested dicts key by key."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def share(n: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous slice ``[lo, hi)`` of ``n`` items that ``rank`` of ``world`` takes."""
    bounds = [len(part) for part in torch.tensor_split(torch.arange(n), world)]
    lo = sum(bounds[:rank])
    return lo, lo + bounds[rank]


def lr_at(train: Any, optimizer_steps: int) -> float:
    """The core default's schedule (``rlmix.defaults.lr_scale``): linear warm-up over
    ``train.warmup_steps``, then flat or, with ``train.lr_schedule: linear``, decaying to 0."""
    from rlmix.defaults import lr_scale

    schedule = str(getattr(train, "lr_schedule", "constant"))
    total = (int(getattr(train, "steps", 0)) * int(getattr(train, "epochs", 1))
             * int(getattr(train, "updates_per_epoch", 1)))
    return float(train.lr) * lr_scale(optimizer_steps, int(train.warmup_steps), schedule, total)


def is_checkpoint_step(run: Run) -> bool:
    """The core checkpointer's rule (``train.checkpoint_every``, and always the last step)."""
    train = run.config.train
    every = int(train.checkpoint_every)
    return run.step >= int(train.steps) or (every > 0 and run.step % every == 0)


# ---------------------------------------------------------------- distributed setup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def import_deepspeed(device_type: str, shm_comm: bool = False) -> Any:
    """Import DeepSpeed with the CPU accelerator when the policy runs on the CPU."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as exc:
        raise rlmix.ConfigError(f"plugin 'deepspeed' needs DeepSpeed ({exc}); install it with "
                                f"'{DS_PIP}'") from None
    if device_type == "cpu" and not shm_comm:
        # the CPU accelerator would JIT-compile a shared-memory allreduce op (minutes on a small
        # machine) at the first init; gloo's allreduce is enough for rlmix's sizes
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def init_distributed(settings: Settings, device_type: str) -> Any:
    """Join the process group torchrun / deepspeed set up in the environment, or make a
    one-process group on loopback when launched plainly."""
    deepspeed = import_deepspeed(device_type, settings.shm_comm)
    if "WORLD_SIZE" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1"})
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = settings.backend
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend)  # a no-op when already initialised
    return deepspeed


def _trainer(run: Run) -> Trainer | None:
    tr = run.plugin_resources(NAME).get("trainer")
    return tr if isinstance(tr, Trainer) else None


# ---------------------------------------------------------------- hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    settings: Settings = run.settings(NAME)
    if settings.stage == 3 and int(run.config.train.max_staleness) > 0:
        # the async sampler's worker refreshes its weight copy from run.policy.model in its own
        # thread; a ZeRO-3 module's state_dict holds empty shards, and gathering the full
        # parameters is a collective the trainer thread may be inside at the same moment
        raise rlmix.ConfigError(
            f"deepspeed.stage: 3 cannot run with train.max_staleness: "
            f"{int(run.config.train.max_staleness)} (asynchronous sampling): the sampler's "
            f"weight copy would be refreshed from partitioned parameters; use stage 0, 1 or 2, "
            f"or train.max_staleness: 0")
    if run.policy is None:
        raise rlmix.ConfigError("plugin 'deepspeed' needs the policy loaded before configure")
    if _trainer(run) is not None:
        return
    device = run.policy.device
    init_distributed(settings, device.type)
    rank, world = rank_and_world()
    train = run.config.train
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        run.policy.model.to(device)
        run.policy.device = device
    if world > 1 and settings.shard and int(train.prompts_per_step) % world:
        raise rlmix.ConfigError(
            f"deepspeed.shard: train.prompts_per_step={int(train.prompts_per_step)} must be a "
            f"multiple of the {world} ranks (each rank samples an equal share), or set "
            f"deepspeed.shard=false")
    if settings.stage == 3 and world > 1 and rank == 0:
        print("rlmix: warning: deepspeed stage 3 on several ranks: every forward all-gathers "
              "parameters, so the ranks must generate in lockstep (same number of decode steps); "
              "a rollout engine that stops early on some ranks hangs (with hf, set "
              "hf.stop_at_eos=false, or sample with ray/vllm)", file=sys.stderr)
    run.plugin_resources(NAME)["setup"] = (rank, world, run.out_dir, device)
    if world > 1 and settings.shard:  # the core trains this rank's rows (Run.minibatches)
        run.shard = (rank, world)
    if rank > 0:  # one run folder for rank 0's metrics and checkpoints; the others log apart
        run.out_dir = run.out_dir / "ranks" / f"rank-{rank}"
    run.state.setdefault(NAME, {"skipped_steps": 0, "optimizer_steps": 0})


@rlmix.hookimpl
def rlmix_prepare_model(run: Run) -> None:
    """The engine wraps (ZeRO-3: partitions) the model only now, after every plugin's
    ``rlmix_configure`` took its reference copies from the full model and, on resume, after the
    core restored the checkpoint's weights into it."""
    if _trainer(run) is not None:
        return
    setup = run.plugin_resources(NAME).pop("setup", None)
    if setup is None or run.policy is None:
        raise RuntimeError("plugin 'deepspeed': rlmix_prepare_model before rlmix_configure")
    rank, world, root, device = setup
    settings: Settings = run.settings(NAME)
    train = run.config.train
    import deepspeed

    model = run.policy.model
    cfg = ds_config(settings, train)
    kwargs: dict[str, Any] = {"model": model, "config": cfg}
    params = [p for p in model.parameters() if p.requires_grad]
    if "optimizer" in cfg:
        kwargs["model_parameters"] = params
    else:
        p = adamw_params(train)
        kwargs["optimizer"] = torch.optim.AdamW(params, lr=p["lr"], betas=tuple(p["betas"]),
                                                eps=p["eps"], weight_decay=p["weight_decay"])
    engine, _, _, _ = deepspeed.initialize(**kwargs)
    # the rollout engine reads run.policy.model: it must be the module DeepSpeed updates
    run.policy.model = engine.module
    run.plugin_resources(NAME)["trainer"] = Trainer(
        engine=engine, settings=settings, rank=rank, world=world, root=root, device=device)


@rlmix.hookimpl
def rlmix_update(run: Run, loss: LossTerms) -> dict[str, Any] | None:
    tr = _trainer(run)
    if tr is None:
        raise RuntimeError("plugin 'deepspeed' has no engine (was rlmix_prepare_model run? "
                           "loop.build_run runs it; after loop.configure call "
                           "loop.prepare_model)")
    engine = tr.engine
    state = run.state.setdefault(NAME, {"skipped_steps": 0, "optimizer_steps": 0})
    _restore_once(run, tr)  # normally done already, before the step's first forward
    value = loss.value
    assert value is not None
    if not bool(torch.isfinite(value.detach()).all()):
        # still run a backward (ZeRO-2/3 reduce inside it; a rank that skipped it would hang
        # the others), but with NaN gradients: DeepSpeed's non-finite-norm check then skips
        # the step on every rank and drops the gradients
        state["pending_bad"] = True
        value = value * float("nan")
    if tr.data_parallel:
        value = value * tr.world  # DeepSpeed averages over ranks; the normalisers are global
    mb: Minibatch | None = loss.minibatch
    last = mb is None or mb.last
    # the core marks the minibatch that closes the optimizer step: reduce and step only there
    engine.set_gradient_accumulation_boundary(last)
    engine.backward(value, scale_wrt_gas=False)
    # what DeepSpeed's engine.forward does first; the core runs the module itself, so do it
    # here, before the next minibatch's forward (ZeRO-3 counts micro-steps with it: without
    # it a second backward overwrites the first's gradient partitions instead of adding)
    clear = getattr(engine.optimizer, "clear_backward_seen_flag", None)
    if clear is not None:
        clear()
    if not last:
        return {}
    lr = lr_at(run.config.train, state["optimizer_steps"])
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    plain_norm = None
    if tr.settings.stage == 0:  # no ZeRO optimizer to report it: the (reduced) .grad norms
        grads = [p.grad.detach().float() for p in engine.module.parameters()
                 if p.grad is not None]
        plain_norm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
    engine.step()
    bad = state.pop("pending_bad", False)
    applied = bool(engine.was_step_applied()) and not bad
    norm = engine.get_global_grad_norm() if plain_norm is None else plain_norm
    norm = float(norm) if norm is not None else math.nan
    stats: dict[str, Any] = {"update/grad_norm": norm}
    if applied:
        state["optimizer_steps"] += 1
        run.policy_version += 1
        stats.update({"update/skipped": 0.0, "update/lr": lr})
    else:
        state["skipped_steps"] += 1
        stats["update/skipped"] = 1.0
        if tr.rank == 0:
            print(f"rlmix: warning: step {run.step + 1}: non-finite loss or gradient; DeepSpeed "
                  f"step skipped, weights unchanged ({state['skipped_steps']} skipped so far)",
                  file=sys.stderr)
    engine.zero_grad()
    return stats


@rlmix.hookimpl(tryfirst=True)
def rlmix_token_logprobs(run: Run, hidden: torch.Tensor, lm_head: torch.nn.Module,
                         labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """ZeRO-3 partitions ``lm_head.weight``: only calling the module gathers it, so under stage 3
    this answers first (through the module); otherwise it declines to the kernel or default."""
    tr = _trainer(run)
    if tr is None or tr.settings.stage != 3:
        return None
    logits = lm_head(hidden).float() / float(run.config.sampling.temperature)
    logz = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - logz
    entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1)
    return logp, entropy


@rlmix.hookimpl(trylast=True)
def rlmix_select_prompts(run: Run, prompts: list[Prompt]) -> list[Prompt] | None:
    """Data parallel (``shard`` on several ranks): this rank's contiguous share of the prompts,
    as a new list (the caller's is left alone). ``trylast``, so every other selection (aero,
    dots) is made first, on the whole list, identically on every rank."""
    tr = _trainer(run)
    if tr is None or not tr.data_parallel:
        return None
    lo, hi = run.share(len(prompts))
    return list(prompts[lo:hi])


@rlmix.hookimpl(wrapper=True, tryfirst=True)
def rlmix_sample(run: Run, prompts: list[Prompt]) -> Any:
    """Several ranks: the owner sampled this rank's share (``rlmix_select_prompts`` above) and
    the shares are all-gathered (``shard``), or rank 0's batch is broadcast; every rank ends
    with the same whole batch."""
    tr = _trainer(run)
    if tr is not None:
        _restore_once(run, tr)
    if tr is None or tr.world == 1:
        return (yield)
    import torch.distributed as dist

    pad = run.tokenizer.pad_token_id if run.tokenizer is not None else 0
    batch = yield
    if not tr.settings.shard:
        box = [batch if tr.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    parts: list[Any] = [None] * tr.world
    dist.all_gather_object(parts, batch)
    return RolloutBatch.concat(parts, pad)


@rlmix.hookimpl(wrapper=True, tryfirst=True)
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor) -> Any:
    """Data parallel: the optimizer step's normalisers become sums over all ranks' shares
    before the loss uses them (once per update; its minibatches share one object)."""
    tr = _trainer(run)
    norm = mb.normalizers
    if tr is not None and tr.data_parallel and not getattr(norm, "_rlmix_global", False):
        import torch.distributed as dist

        counts = torch.tensor([norm.tokens, norm.sequences], dtype=torch.float64,
                              device=tr.device)
        dist.all_reduce(counts)
        norm.tokens, norm.sequences = float(counts[0]), float(counts[1])
        norm._rlmix_global = True  # type: ignore[attr-defined]
    return (yield)


@rlmix.hookimpl(wrapper=True)
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> Any:
    """Whole-batch reward metrics on every rank; on checkpoint steps the DeepSpeed state and
    consolidated fp32 weights, and (stage 3) gathered parameters while the core's checkpointer
    saves the model."""
    tr = _trainer(run)
    if tr is None:
        return (yield)
    if tr.data_parallel:  # the reward metrics are the whole batch's already (run.shard)
        import torch.distributed as dist

        if "loss" in metrics:  # each rank's loss is its share of the whole batch's: sum them
            total = torch.tensor([float(metrics["loss"])], dtype=torch.float64, device=tr.device)
            dist.all_reduce(total)
            metrics["loss"] = float(total[0])
    checkpoint = is_checkpoint_step(run)
    if checkpoint:
        save_engine(run, tr)
    gather: contextlib.AbstractContextManager = contextlib.nullcontext()
    if checkpoint and tr.settings.stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(tr.engine.module.parameters()),
                                                   modifier_rank=None)
    with gather:
        return (yield)


# ---------------------------------------------------------------- checkpoints


def consolidated_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The full fp32 weights (the optimizer's master copy where it keeps one), on CPU, on every
    rank. Collective: every rank must call it."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        full = safe_get_full_fp32_param(param) if param.requires_grad else None
        if full is None:
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                full = param.detach().float().clone()
        state[name] = full.detach().float().cpu().clone()
    saved = set(module.state_dict().keys())
    for name, buf in module.named_buffers():
        if name in saved:
            state[name] = buf.detach().cpu().clone()
    return state


def save_pretrained(run: Run, folder: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write consolidated fp32 weights (and the tokenizer) to ``folder`` in the layout
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads; atomic. Collective: every rank
    calls it, rank 0 writes."""
    tr = _trainer(run)
    assert tr is not None and run.policy is not None
    state = consolidated_state_dict(tr.engine) if state is None else state
    if tr.rank == 0:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
        try:
            module = tr.engine.module
            dtype = module.config.dtype if hasattr(module.config, "dtype") else None
            module.config.dtype = torch.float32  # the weights written are fp32
            try:
                module.save_pretrained(tmp, state_dict=state)
            finally:
                if dtype is not None:
                    module.config.dtype = dtype
            if run.tokenizer is not None:
                run.tokenizer.save_pretrained(tmp)
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _barrier()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def engine_root(tr: Trainer) -> Path:
    return tr.root / "checkpoints" / "deepspeed"


def save_engine(run: Run, tr: Trainer) -> Path:
    """DeepSpeed's own checkpoint (optimizer partitions, every rank) under
    ``<run>/checkpoints/deepspeed/step-NNNNNN`` and, with ``save_hf``, the consolidated
    weights in its ``hf/``. A folder counts only once its completion marker is written."""
    root = engine_root(tr)
    tag = f"step-{run.step:06d}"
    tr.engine.save_checkpoint(str(root), tag=tag)
    if tr.settings.save_hf:
        save_pretrained(run, root / tag / "hf")
    if tr.rank == 0:
        (root / tag / COMPLETE).write_text(str(run.step))
        keep = int(run.config.train.keep_checkpoints)
        done = sorted(p for p in root.glob("step-*") if (p / COMPLETE).exists())
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return root / tag


def _restore_once(run: Run, tr: Trainer) -> None:
    if not tr.resume_checked:
        tr.resume_checked = True
        restore_engine(run, tr)


def restore_engine(run: Run, tr: Trainer) -> None:
    """Before the first step of a resumed run (it changes parameters in place, so it must come
    before any forward that a backward will use), load DeepSpeed's state saved at its step."""
    if run.step == 0:
        return
    tag = f"step-{run.step:06d}"
    folder = engine_root(tr) / tag
    if not (folder / COMPLETE).exists():
        if tr.rank == 0:
            print(f"rlmix: warning: no DeepSpeed state at {folder}; resuming with fresh "
                  f"optimizer moments", file=sys.stderr)
        # the core restored the module's weights; ZeRO's fp32 master copy must follow them
        refresh = getattr(tr.engine.optimizer, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()
        return
    tr.engine.load_checkpoint(str(engine_root(tr)), tag=tag, load_module_strict=False)
