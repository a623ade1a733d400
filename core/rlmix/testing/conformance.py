"""The conformance kit: does a plugin keep the contract of every hook it implements?

    from rlmix.testing.conformance import check_plugin

    report = check_plugin("myplugin")              # an installed plugin, by entry-point name
    report = check_plugin("myplugin", my_module)   # or an object in this process
    assert report.ok, report.format()

For each hook the plugin implements the kit checks shapes and dtypes, that masks are respected
(for ``rlmix_clip``: the gradient of the aggregated loss is zero wherever ``completion_mask`` is
0), that edge batches give no NaN (a group of identical rewards, a single-token completion, an
empty completion row), determinism under a seed; and for every plugin: that its ``Settings``
validate (defaults build, a wrong-typed value and an unknown key are rejected), that it
configures and runs one training step, and that what it keeps in ``run.state`` survives
``torch.save``/``torch.load``. Hooks it does not own are served by the stand-ins of
``rlmix.testing.standins``, registered before it. A failure says what to fix.

Two levels: ``quick`` (a few seconds; ``rlmix plugins --check``) and ``full`` (adds seeded
re-runs, minibatch-split invariance, gradient accumulation and a checkpoint resume;
``pytest --rlmix-conformance NAME``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.metadata as md
import inspect
import io
import json
import math
import random
import shutil
import tempfile
import time
import traceback
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlmix import hookspecs, loop, manifest, needs, ops
from rlmix import plugins as plugin_loading
from rlmix.errors import ManifestError
from rlmix.testing import standins
from rlmix.types import (
    LOSS_MODES,
    GenerationRequest,
    HarnessUpdate,
    LossTerms,
    Minibatch,
    Normalizers,
    Prompt,
    RolloutBatch,
    Run,
)

LEVELS = ("quick", "full")
HOOKS = tuple(sorted(n for n in dir(hookspecs) if n.startswith("rlmix_")))
#: manifest overrides every kit run starts from (tiny model, small batches, no files but one)
BASE_OVERRIDES = ("model=tiny-random", "policy.device=cpu", "log.progress=false",
                  "log.plot=false", "log.tensorboard=false", "train.prompts_per_step=2",
                  "train.group_size=4", "train.seed=0")


class ConformanceFailure(AssertionError):
    """A broken contract; the message says what to fix."""


class NotApplicable(Exception):
    """The check does not apply to this plugin (reported as skipped)."""


@dataclass
class Result:
    plugin: str
    check: str  # "<hook or topic>/<what>", e.g. "rlmix_clip/mask"
    ok: bool
    message: str = ""
    skipped: bool = False
    seconds: float = 0.0


@dataclass
class Report:
    plugin: str
    results: list[Result] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    def format(self) -> str:
        lines = [f"rlmix conformance of '{self.plugin}': "
                 f"{sum(r.ok and not r.skipped for r in self.results)} passed, "
                 f"{len(self.failures)} failed, {sum(r.skipped for r in self.results)} skipped"]
        for r in self.results:
            if not r.ok:
                lines.append(f"  FAIL {r.check}: {r.message}")
        return "\n".join(lines)


@dataclass
class Check:
    id: str
    hook: str  # the hook it needs the plugin to implement, or "" for every plugin
    level: str
    fn: Callable[[Subject], None]
    owner_only: bool = False  # skip for wrapper-only implementations
    needs_run: bool = True  # skipped when no run configures (plugin/configure says why)

    @property
    def doc(self) -> str:
        return " ".join((self.fn.__doc__ or "").split())


CHECKS: list[Check] = []


def check(hook: str, name: str, level: str = "quick", owner_only: bool = False,
          needs_run: bool = True) -> Callable[[Callable[[Subject], None]], Callable]:
    def register(fn: Callable[[Subject], None]) -> Callable[[Subject], None]:
        topic = hook or "plugin"
        CHECKS.append(Check(f"{topic}/{name}", hook, level, fn, owner_only, needs_run))
        return fn
    return register


# ---------------------------------------------------------------------------- the subject


class Subject:
    """The plugin under test: its object, hooks, settings class, and a factory of ``Run``s in
    which the kit's stand-ins are registered before it."""

    def __init__(self, name: str, obj: Any = None) -> None:
        self.name = name
        self.inline = obj is not None
        self.load_error: str | None = None
        if obj is None:
            obj = self._load()
        self.obj = obj
        self.settings_cls = plugin_loading.settings_class(obj) if obj is not None else None
        attrs = [a for a in dir(obj) if a.startswith("rlmix_")] if obj is not None else []
        self.hooks = [a for a in attrs if a in HOOKS and callable(getattr(obj, a))]
        self.unknown = [a for a in attrs if a not in HOOKS and callable(getattr(obj, a))]
        self.wrappers = {h for h in self.hooks if _impl_opts(getattr(obj, h)).get("wrapper")
                         or _impl_opts(getattr(obj, h)).get("hookwrapper")}
        self.tmp = Path(tempfile.mkdtemp(prefix="rlmix-conformance-"))
        self._runs = 0
        self.cache: dict[str, Any] = {}

    def _load(self) -> Any:
        info = plugin_loading.installed().get(self.name)
        if info is None:
            known = sorted(plugin_loading.installed())
            close = difflib.get_close_matches(self.name, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            self.load_error = (f"no installed rlmix plugin is named '{self.name}'{hint}; install "
                               f"it (pip install -e <its folder>) so its entry point is "
                               f"registered, or pass the object: check_plugin(name, module)")
            return None
        try:
            return md.EntryPoint(name=info.name, value=info.value, group=info.family).load()
        except Exception as exc:  # noqa: BLE001 - reported as the first failure
            self.load_error = (f"entry point '{info.name} = {info.value}' ({info.family}) failed "
                               f"to import: {type(exc).__name__}: {exc}")
            return None

    def implements(self, hook: str) -> bool:
        return hook in self.hooks

    def owns(self, hook: str) -> bool:
        return hook in self.hooks and hook not in self.wrappers

    def run(self, overrides: Iterable[str] = (), policy: bool = True, configure: bool = True,
            probes: dict[str, Any] | None = None) -> Run:
        """A ``Run`` with the stand-ins, then the plugin, then ``probes``; the tiny model when
        ``policy``; every plugin configured when ``configure``."""
        self._runs += 1
        names = [*standins.STANDINS, self.name, *(probes or {})]
        extra: dict[str, Any] = {**standins.STANDINS, **(probes or {})}
        if self.inline:
            extra[self.name] = self.obj
        cfg = manifest.read(None, [*BASE_OVERRIDES, f"out={self.tmp / f'run{self._runs}'}",
                                   *overrides])
        cfg.plugins = names
        run, _ = loop.prepare(cfg, extra_plugins=extra, required={})
        if policy:
            loop.load_policy(run)
        if configure:
            loop.configure(run)
            loop.prepare_model(run)  # as build_run: a trainer plugin wraps the model here
        return run

    def shared(self) -> Run:
        """One configured run with the tiny model, reused by checks that only read from it."""
        if "shared" not in self.cache:
            self.cache["shared"] = self.run()
        return self.cache["shared"]

    def impl(self, run: Run, hook: str) -> Any:
        """The plugin's own implementation of ``hook`` in ``run`` (not the stand-ins')."""
        for impl in getattr(run.pm.hook, hook).get_hookimpls():
            if impl.plugin_name == self.name:
                return impl
        raise ConformanceFailure(f"{hook} of '{self.name}' is not registered")

    def close(self) -> None:
        self.cache.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _impl_opts(fn: Any) -> dict[str, Any]:
    return getattr(fn, f"{hookspecs.PROJECT}_impl", None) or {}


# ---------------------------------------------------------------------------- helpers


def _rows(index: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``"0-3, 6"``."""
    rows = sorted(set(int(i) for i in index))
    parts, start = [], None
    for i, r in enumerate(rows):
        if start is None:
            start = r
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            parts.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def _at(index: Iterable[int]) -> str:
    """``"row 3"`` or ``"rows 0-3, 6"``."""
    rows = sorted(set(int(i) for i in index))
    return f"row {rows[0]}" if len(rows) == 1 else f"rows {_rows(rows)}"


def _shape(t: Any) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _where_raised(exc: BaseException, subject: Subject) -> str:
    """``file:line in function`` of the innermost frame in the plugin's own code."""
    module = inspect.getmodule(subject.obj) if subject.obj is not None else None
    own = getattr(module, "__file__", None)
    folder = str(Path(own).parent) if own else None
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if folder and frame.filename.startswith(folder):
            return f" (at {Path(frame.filename).name}:{frame.lineno} in {frame.name})"
    return ""


def kit_batch(run: Run, prompts: list[Prompt] | None = None, max_new_tokens: int = 6,
              n: int | None = None) -> RolloutBatch:
    """A scored batch from the fake rollout (not through the hooks), on the run's prompts."""
    if prompts is None:
        prompts = run.hook.rlmix_prompts(run=run, step=run.step)
    request = GenerationRequest(prompts=prompts, n=n or int(run.config.train.group_size),
                                temperature=1.0, max_new_tokens=max_new_tokens)
    batch = standins.FakeRollout().rlmix_generate(run=run, request=request)
    loop.score(run, batch)
    return batch


def _pad_id(run: Run) -> int:
    tok = run.tokenizer
    return int(tok.pad_token_id) if tok is not None and tok.pad_token_id is not None else 0


def _truncate_row(run: Run, batch: RolloutBatch, row: int, keep: int) -> None:
    """Keep the first ``keep`` completion tokens of ``row`` (0 = an empty completion row)."""
    cols = batch.completion_mask[row].nonzero().flatten()
    if len(cols) == 0:
        return
    start = int(cols[0]) + keep
    batch.completion_mask[row, start:] = 0
    batch.attention_mask[row, start:] = 0
    batch.tokens[row, start:] = _pad_id(run)
    batch.behavior_logp[row, start:] = 0
    kept = batch.tokens[row, int(cols[0]):start].tolist()
    if run.tokenizer is not None:
        batch.texts[row] = run.tokenizer.decode(kept, skip_special_tokens=True)
    else:
        batch.texts[row] = "".join(standins.ALPHABET[(t - 2) % len(standins.ALPHABET)]
                                   for t in kept)


def edge_batches(run: Run) -> list[tuple[str, list[int], RolloutBatch]]:
    """``(description, rows it concerns, batch)`` for each edge case, scored by the run."""
    group_size = int(run.config.train.group_size)
    out = []
    batch = kit_batch(run)
    rows = list(range(group_size))
    assert batch.rewards is not None
    for v in batch.reward_terms.values():
        v[rows] = v[rows[0]].clone()
    batch.rewards[rows] = 1.0
    out.append((f"a group of identical rewards ({_at(rows)})", rows, batch))
    batch = kit_batch(run)
    _truncate_row(run, batch, 0, 1)
    loop.score(run, batch)
    out.append(("a single-token completion (row 0)", [0], batch))
    batch = kit_batch(run)
    _truncate_row(run, batch, 1, 0)
    loop.score(run, batch)
    out.append(("an empty completion row (row 1)", [1], batch))
    return out


def _normalizers(run: Run, batch: RolloutBatch) -> Normalizers:
    return Normalizers(tokens=float(batch.completion_mask.sum().clamp(min=1)),
                       sequences=float(len(batch)),
                       norm_constant=float(run.config.train.loss_norm_constant
                                           or run.config.sampling.max_new_tokens))


def _logprobs(run: Run, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Leaf tensors ``(logp, entropy)`` from the tiny policy, for gradients w.r.t. them."""
    assert run.policy is not None
    with torch.no_grad():
        logp, entropy = run.policy.logprobs(run, batch)
    return (logp.detach().float().clone().requires_grad_(True),
            entropy.detach().float().clone().requires_grad_(True))


@contextlib.contextmanager
def _stale(run: Run, batch: RolloutBatch, seed: int = 0) -> Iterator[None]:
    """Make ``batch`` look one policy version old, with behaviour log-probs away from the
    current policy's, so ratio- and staleness-based losses take their off-policy paths."""
    g = torch.Generator().manual_seed(seed)
    noise = 0.3 * torch.randn(batch.behavior_logp.shape, generator=g)
    batch.behavior_logp = (batch.behavior_logp + noise).clamp(max=0) * batch.completion_mask
    saved = run.policy_version
    run.policy_version = int(batch.policy_version.max()) + 1
    try:
        yield
    finally:
        run.policy_version = saved


def _advantages(run: Run, batch: RolloutBatch) -> None:
    """The run's advantages; where they are unusable (rlmix_advantage's own checks report
    that), the stand-in's, so rlmix_clip is judged on valid input."""
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    ok = isinstance(adv, torch.Tensor) and tuple(adv.shape) in (
        (len(batch),), tuple(batch.tokens.shape)) and bool(torch.isfinite(adv).all())
    if not ok:
        adv = standins.SimpleAlgorithm().rlmix_advantage(run=run, batch=batch)
    batch.advantages = adv


def _clip(run: Run, batch: RolloutBatch, normalizers: Normalizers | None = None
          ) -> tuple[LossTerms, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(terms, aggregated value, logp leaf, entropy leaf)`` of the run's rlmix_clip."""
    logp, entropy = _logprobs(run, batch)
    normalizers = normalizers or _normalizers(run, batch)
    mb = Minibatch(batch=batch, normalizers=normalizers)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    _check_loss_terms(terms, batch)
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, normalizers)
    if terms.extra is not None:
        value = value + terms.extra
    return terms, value, logp, entropy


def _check_loss_terms(terms: Any, batch: RolloutBatch) -> None:
    expected = tuple(batch.tokens.shape)
    if terms is None:
        raise ConformanceFailure("rlmix_clip returned None; return LossTerms(loss=..., mask=...)")
    if not isinstance(terms, LossTerms):
        raise ConformanceFailure(f"rlmix_clip returned {type(terms).__name__}; expected "
                                 f"rlmix.LossTerms")
    for name in ("loss", "mask"):
        value = getattr(terms, name)
        if not isinstance(value, torch.Tensor):
            raise ConformanceFailure(f"rlmix_clip returned LossTerms.{name} of type "
                                     f"{type(value).__name__}; expected a tensor of shape "
                                     f"{expected} = mb.batch.tokens.shape")
        if tuple(value.shape) != expected:
            raise ConformanceFailure(f"rlmix_clip returned {name} of shape {_shape(value)}; "
                                     f"expected {expected} = mb.batch.tokens.shape")
    if not terms.loss.is_floating_point():
        raise ConformanceFailure(f"rlmix_clip returned loss of dtype {terms.loss.dtype}; "
                                 f"expected a floating-point tensor")
    if terms.mode not in LOSS_MODES:
        raise ConformanceFailure(f"rlmix_clip returned mode {terms.mode!r}; choose one of "
                                 f"{', '.join(LOSS_MODES)}")
    if terms.extra is not None and (not isinstance(terms.extra, torch.Tensor)
                                    or terms.extra.numel() != 1):
        raise ConformanceFailure(f"rlmix_clip returned LossTerms.extra of shape "
                                 f"{_shape(terms.extra)}; expected a scalar tensor (an "
                                 f"already-normalised term added after aggregation)")
    for key, value in terms.metrics.items():
        try:
            float(value)
        except (TypeError, ValueError):
            raise ConformanceFailure(f"rlmix_clip returned metric '{key}' = {value!r}, which "
                                     f"float() cannot convert; metrics must be numbers"
                                     ) from None


def _batch_problems(batch: Any, hook: str) -> list[str]:
    """Structural problems of a RolloutBatch, each a sentence that says what to fix."""
    if not isinstance(batch, RolloutBatch):
        return [f"{hook} returned {type(batch).__name__}; expected rlmix.RolloutBatch"]
    problems = []
    n, width = batch.tokens.shape
    if batch.tokens.is_floating_point():
        problems.append(f"{hook} returned tokens of dtype {batch.tokens.dtype}; expected "
                        f"integer token ids (torch.long)")
    for name in ("attention_mask", "completion_mask", "behavior_logp"):
        value = getattr(batch, name)
        if tuple(value.shape) != (n, width):
            problems.append(f"{hook} returned {name} of shape {_shape(value)}; expected "
                            f"{(n, width)} = batch.tokens.shape")
    for name in ("group", "policy_version"):
        value = getattr(batch, name)
        if tuple(value.shape) != (n,):
            problems.append(f"{hook} returned {name} of shape {_shape(value)}; expected ({n},)")
    for name in ("texts", "prompts"):
        if len(getattr(batch, name)) != n:
            problems.append(f"{hook} returned {len(getattr(batch, name))} {name} for {n} rows; "
                            f"give one per row (prompts: the Prompt each row answers)")
    if problems:
        return problems
    cmask = batch.completion_mask > 0
    outside = cmask & (batch.attention_mask == 0)
    if outside.any():
        rows = outside.any(-1).nonzero().flatten().tolist()
        problems.append(f"{hook} returned completion_mask 1 where attention_mask is 0 ("
                        f"{_at(rows)}); generated tokens are attended tokens")
    blogp = batch.behavior_logp.float()
    if not torch.isfinite(blogp[cmask]).all():
        rows = (~torch.isfinite(blogp) & cmask).any(-1).nonzero().flatten().tolist()
        problems.append(f"{hook} returned non-finite behavior_logp on completion tokens ("
                        f"{_at(rows)}); record the sampling distribution's log-prob of each "
                        f"sampled token")
    elif (blogp[cmask] > 1e-4).any():
        problems.append(f"{hook} returned behavior_logp > 0 on completion tokens (max "
                        f"{float(blogp[cmask].max()):.3g}); these are log-probabilities (<= 0)")
    off = blogp[~cmask]
    if len(off) and (~torch.isfinite(off) | (off.abs() > 1e-6)).any():
        problems.append(f"{hook} returned behavior_logp != 0 outside the completion (prompt and "
                        f"padding columns); set it to 0 where completion_mask is 0")
    return problems


def _same(a: Any, b: Any, path: str = "") -> str | None:
    """Where ``a`` and ``b`` differ (tensors compared exactly, NaN equal to NaN), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{path}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        if not torch.equal(a.cpu(), b.cpu()) and not (
                a.is_floating_point() and torch.allclose(a.cpu(), b.cpu(), equal_nan=True,
                                                         rtol=0, atol=0)):
            return f"{path}: tensor values differ"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            found = _same(a[k], b[k], f"{path}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b) or type(a) is not type(b):
            return f"{path}: {type(a).__name__} of {len(a)} vs {type(b).__name__} of {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _same(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    try:
        equal = bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==
        equal = repr(a) == repr(b)
    return None if equal else f"{path}: {a!r} vs {b!r}"


def _finite_rows(t: torch.Tensor) -> list[int]:
    bad = ~torch.isfinite(t.detach().float())
    if bad.dim() > 1:
        bad = bad.flatten(1).any(-1)
    return bad.nonzero().flatten().tolist()


def _nan_word(t: torch.Tensor) -> str:
    t = t.detach().float()
    return "NaN" if torch.isnan(t).any() else "inf"


# ---------------------------------------------------------------------------- every plugin


@check("", "registers", needs_run=False)
def _registers(s: Subject) -> None:
    """The plugin imports, its rlmix_* names are hooks, and pluggy accepts its hookimpls."""
    problems = []
    for name in s.unknown:
        close = difflib.get_close_matches(name, HOOKS, n=1)
        hint = f"; did you mean {close[0]}?" if close else "; rename it (rlmix_ is reserved)"
        problems.append(f"{name} is not an rlmix hook{hint}")
    for hook in s.hooks:
        fn = getattr(s.obj, hook)
        opts = _impl_opts(fn)
        if not opts:
            problems.append(f"{hook} is not marked @rlmix.hookimpl, so it is never called; "
                            f"decorate it")
            continue
        is_gen = inspect.isgeneratorfunction(fn)
        wrapper = bool(opts.get("wrapper") or opts.get("hookwrapper"))
        if is_gen and not wrapper:
            problems.append(f"{hook} is a generator but not marked "
                            f"@rlmix.hookimpl(wrapper=True); as it is, the hook's result "
                            f"would be a generator object")
        if wrapper and hook in ("rlmix_score", "rlmix_configure", "rlmix_evaluate"):
            if hook == "rlmix_score":
                problems.append("rlmix_score is marked wrapper=True, but the core calls every "
                                "scorer on its own and never calls score wrappers; return a "
                                "reward term instead (a negative weight subtracts it)")
    if problems:
        raise ConformanceFailure("; ".join(problems))
    pm = plugin_loading.new_plugin_manager()
    try:
        plugin_loading.register(pm, [plugin_loading.LoadedPlugin(s.name, "", s.obj, None)])
    except Exception as exc:  # noqa: BLE001 - pluggy's validation of the hookimpls
        raise ConformanceFailure(f"pluggy rejects the plugin's hookimpls: {exc}; a hookimpl "
                                 f"may take only arguments its hook passes (see "
                                 f"docs/hooks.md)") from None


@check("", "settings", needs_run=False)
def _settings(s: Subject) -> None:
    """Settings is a dataclass whose defaults build through the manifest validator, and a
    wrong-typed value and an unknown key are rejected with ManifestError."""
    raw = getattr(s.obj, "Settings", None)
    if raw is None:
        raise NotApplicable("the plugin has no Settings (it takes no manifest block)")
    if not dataclasses.is_dataclass(raw):
        raise ConformanceFailure("Settings is not a dataclass, so the core ignores it and any "
                                 f"'{s.name}:' block is rejected; decorate it with "
                                 "@dataclasses.dataclass")
    cls = raw
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConformanceFailure(f"Settings field(s) {', '.join(missing)} have no default; every "
                                 f"field needs one so the plugin runs when its manifest block "
                                 f"is absent")
    try:
        manifest.validate_block(cls, {}, s.name, s.name)
    except ManifestError as exc:
        raise ConformanceFailure(f"Settings() with its defaults is rejected: {exc}; make the "
                                 f"defaults valid (they are what a manifest without a "
                                 f"'{s.name}:' block runs with)") from None
    except Exception as exc:  # noqa: BLE001 - OmegaConf cannot even build the schema
        raise ConformanceFailure(f"the manifest validator cannot build Settings: "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0]}; use field "
                                 f"types OmegaConf supports (str, int, float, bool, enums, "
                                 f"lists/dicts of those, nested dataclasses)") from None
    try:
        manifest.validate_block(cls, {"kit_no_such_key": 1}, s.name, s.name)
    except ManifestError:
        pass
    else:
        raise ConformanceFailure(f"an unknown key '{s.name}.kit_no_such_key' was accepted; "
                                 f"Settings must be a plain dataclass (no **kwargs catch-all)")
    hints = typing.get_type_hints(cls)
    typed = [f.name for f in dataclasses.fields(cls) if hints.get(f.name) in (int, float, bool)]
    for name in typed:
        try:
            manifest.validate_block(cls, {name: "kit-not-a-number"}, s.name, s.name)
        except ManifestError:
            continue
        raise ConformanceFailure(f"'{s.name}.{name}: kit-not-a-number' was accepted for a "
                                 f"{hints[name].__name__} field; keep the field annotated "
                                 f"with its type so the manifest validator checks it")


@check("", "configure")
def _configure(s: Subject) -> None:
    """The plugin configures with its default settings on the tiny model."""
    try:
        s.shared()
    except Exception as exc:  # noqa: BLE001
        s.cache["configure_error"] = True
        raise ConformanceFailure(f"the run did not configure with default settings: "
                                 f"{type(exc).__name__}: {exc}{_where_raised(exc, s)}") from None


def _step(s: Subject, run: Run) -> dict[str, Any]:
    try:
        metrics = loop.train_step(run)
        run.hook.rlmix_step_end(run=run, metrics=metrics)
        if s.implements("rlmix_evaluate"):
            metrics.update(loop.evaluate(run))
    except ConformanceFailure:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConformanceFailure(
            f"one training step with the kit's stand-ins ({', '.join(standins.STANDINS)} "
            f"registered before '{s.name}') failed: {type(exc).__name__}: {exc}"
            f"{_where_raised(exc, s)}") from None
    return metrics


@check("", "step")
def _one_step(s: Subject) -> None:
    """One training step (and its step_end, and evaluation when implemented) runs, with a finite
    loss, numeric metrics, and an optimizer step taken."""
    run = s.run()
    metrics = _step(s, run)
    s.cache["stepped"] = run
    bad = []
    for key, value in metrics.items():
        try:
            json.dumps(float(value) if not isinstance(value, (int, str)) else value)
        except (TypeError, ValueError):
            bad.append(f"{key}={value!r}")
    if bad:
        raise ConformanceFailure(f"the step's metrics are not numbers: {', '.join(bad[:3])}; "
                                 f"metrics are logged as JSON numbers")
    if not math.isfinite(float(metrics["loss"])):
        raise ConformanceFailure(f"one training step gave loss {metrics['loss']}; the loss must "
                                 f"be finite on an ordinary batch")
    if run.policy_version != 1:
        raise ConformanceFailure(f"after one training step run.policy_version is "
                                 f"{run.policy_version}, not 1: the optimizer step was skipped "
                                 f"(a non-finite loss or gradient) or rlmix_update did not bump "
                                 f"the version")


@check("", "state")
def _state(s: Subject) -> None:
    """What the plugin keeps in run.state survives torch.save/torch.load unchanged."""
    run = s.cache.get("stepped")
    if run is None:
        run = s.run()
    buffer = io.BytesIO()
    try:
        torch.save(run.state, buffer)
    except Exception as exc:  # noqa: BLE001
        raise ConformanceFailure(f"run.state cannot be saved by torch.save ({type(exc).__name__}: "
                                 f"{exc}); keep only picklable data there (tensors, numbers, "
                                 f"strings, lists, dicts) and put other objects in "
                                 f"run.resources") from None
    buffer.seek(0)
    try:
        loaded = torch.load(buffer, weights_only=False)
    except Exception as exc:  # noqa: BLE001
        raise ConformanceFailure(f"run.state is saved but cannot be loaded back "
                                 f"({type(exc).__name__}: {exc})") from None
    diff = _same(run.state, loaded, "run.state")
    if diff:
        raise ConformanceFailure(f"run.state changes in a torch.save/torch.load round trip at "
                                 f"{diff}; a resumed run would see other state")


@check("", "resume", level="full")
def _resume(s: Subject) -> None:
    """Two steps equal one step, a checkpoint, a restore into a fresh run, and one more step."""
    from rlmix import checkpoint

    straight = s.run()
    _step(s, straight)
    second = _step(s, straight)
    first = s.run()
    _step(s, first)
    folder = checkpoint.save(first, keep=1)
    resumed = s.run()
    checkpoint.restore(resumed, folder)
    again = _step(s, resumed)
    for key in ("loss", "reward/mean"):
        if not math.isclose(float(second[key]), float(again[key]), rel_tol=1e-5, abs_tol=1e-6):
            raise ConformanceFailure(f"step 2 after a checkpoint resume gives {key} "
                                     f"{again[key]:.6g}, an uninterrupted run {second[key]:.6g}; "
                                     f"keep what a step depends on in run.state (checkpointed) "
                                     f"and derive randomness from run.rng or the step")
    diff = _same(straight.state, resumed.state, "run.state")
    if diff:
        raise ConformanceFailure(f"after a resume run.state differs from an uninterrupted run at "
                                 f"{diff}")


# ---------------------------------------------------------------------------- rlmix_advantage


def _check_advantage(adv: Any, batch: RolloutBatch, where: str) -> torch.Tensor:
    n, width = batch.tokens.shape
    if not isinstance(adv, torch.Tensor):
        raise ConformanceFailure(f"rlmix_advantage returned {type(adv).__name__}{where}; "
                                 f"expected a tensor of shape ({n},) or ({n}, {width})")
    if tuple(adv.shape) not in ((n,), (n, width)):
        raise ConformanceFailure(f"rlmix_advantage returned shape {_shape(adv)}{where}; expected "
                                 f"({n},) or ({n}, {width}) = (len(batch),) or batch.tokens.shape")
    if not adv.is_floating_point():
        raise ConformanceFailure(f"rlmix_advantage returned dtype {adv.dtype}{where}; expected "
                                 f"a floating-point tensor")
    return adv


@check("rlmix_advantage", "shape")
def _advantage_shape(s: Subject) -> None:
    """Advantages are float [N] or [N, T], finite, and the batch's rewards are left as they
    were."""
    run = s.shared()
    batch = kit_batch(run)
    assert batch.rewards is not None
    rewards = batch.rewards.clone()
    tokens = batch.tokens.clone()
    adv = _check_advantage(run.hook.rlmix_advantage(run=run, batch=batch), batch, "")
    bad = _finite_rows(adv)
    if bad:
        raise ConformanceFailure(f"rlmix_advantage returned {_nan_word(adv)} at "
                                 f"{_at(bad)} on an ordinary batch")
    if not torch.equal(batch.rewards, rewards) or not torch.equal(batch.tokens, tokens):
        raise ConformanceFailure("rlmix_advantage changed batch.rewards or batch.tokens in "
                                 "place; return new advantages and leave the batch's data as "
                                 "it was (to reshape rewards, add an rlmix_score term)")


@check("rlmix_advantage", "edge")
def _advantage_edge(s: Subject) -> None:
    """No NaN or inf on a group of identical rewards, a single-token completion, an empty
    completion row."""
    run = s.shared()
    for what, rows, batch in edge_batches(run):
        adv = _check_advantage(run.hook.rlmix_advantage(run=run, batch=batch), batch,
                               f" on {what}")
        bad = _finite_rows(adv)
        if bad:
            hint = ("guard the division by the group's std (add eps to it)"
                    if "identical" in what else
                    "guard divisions by a row's token count (clamp it to >= 1)")
            at = "" if sorted(bad) == sorted(rows) else f" (at {_at(bad)})"
            raise ConformanceFailure(f"rlmix_advantage returned {_nan_word(adv)} on {what}"
                                     f"{at}; {hint}")


@check("rlmix_advantage", "determinism", level="full")
def _advantage_determinism(s: Subject) -> None:
    """Two fresh runs with the same seed give the same advantages."""
    outs = []
    for _ in range(2):
        run = s.run()
        batch = kit_batch(run)
        outs.append(run.hook.rlmix_advantage(run=run, batch=batch))
    if _same(outs[0], outs[1]):
        raise ConformanceFailure("rlmix_advantage is not deterministic: two fresh runs with "
                                 "train.seed=0 give different advantages on the same batch; "
                                 "draw randomness from run.rng or a torch.Generator seeded from "
                                 "run.config.train.seed")


# ---------------------------------------------------------------------------- rlmix_clip


@check("rlmix_clip", "shape")
def _clip_shape(s: Subject) -> None:
    """LossTerms with loss and mask of shape mb.batch.tokens.shape, a known mode, a scalar
    extra, numeric metrics, and a finite loss that depends on logp."""
    run = s.shared()
    batch = kit_batch(run)
    _advantages(run, batch)
    terms, value, logp, _ = _clip(run, batch)
    if not torch.isfinite(value.detach()).all():
        raise ConformanceFailure(f"rlmix_clip gave an aggregated loss of {float(value)} on an "
                                 f"ordinary batch")
    if not value.requires_grad:
        raise ConformanceFailure("rlmix_clip returned a loss with no gradient (detached from "
                                 "logp); build the loss from the logp argument")


@check("rlmix_clip", "mask")
def _clip_mask(s: Subject) -> None:
    """The gradient of the aggregated loss w.r.t. logp and entropy is zero wherever
    completion_mask is 0, and LossTerms.mask stays inside completion_mask."""
    run = s.shared()
    # a loss that declares it does without advantages (rlmix.needs) need not follow them
    follows_advantages = "rlmix_advantage" not in needs.declared(s.obj)
    for stale in (False, True):
        batch = kit_batch(run)
        _advantages(run, batch)
        with _stale(run, batch) if stale else contextlib.nullcontext():
            _clip_mask_on(run, batch, " (samples one policy version old)" if stale else "",
                          follows_advantages)


def _clip_mask_on(run: Run, batch: RolloutBatch, where: str,
                  follows_advantages: bool = True) -> None:
    terms, value, logp, entropy = _clip(run, batch)
    cmask = batch.completion_mask > 0
    outside = (terms.mask.detach() != 0) & ~cmask
    if outside.any():
        row, col = (int(i) for i in outside.nonzero()[0])
        raise ConformanceFailure(f"rlmix_clip returned a mask that is nonzero at "
                                 f"{int(outside.sum())} positions where completion_mask is 0 "
                                 f"(first: row {row}, column {col}){where}; prompt and padding "
                                 f"tokens must not enter the loss: multiply your mask by "
                                 f"mb.batch.completion_mask")
    value.backward()
    for name, leaf in (("logp", logp), ("entropy", entropy)):
        grad = leaf.grad
        if grad is None:
            continue
        if not torch.isfinite(grad).all():
            raise ConformanceFailure(f"the gradient of rlmix_clip's loss w.r.t. {name} has "
                                     f"NaN/inf ({_at(_finite_rows(grad))}){where}")
        leak = (grad != 0) & ~cmask
        if leak.any():
            row, col = (int(i) for i in leak.nonzero()[0])
            raise ConformanceFailure(f"the gradient of rlmix_clip's aggregated loss w.r.t. "
                                     f"{name} is nonzero at {int(leak.sum())} positions where "
                                     f"completion_mask is 0 (first: row {row}, column {col})"
                                     f"{where}; mask every term of the loss, including terms "
                                     f"added to LossTerms.extra")
    adv = batch.token_advantages()
    if follows_advantages and (adv[cmask] != 0).any() and (
            logp.grad is None or not (logp.grad != 0).any()):
        raise ConformanceFailure(f"rlmix_clip's loss has zero gradient w.r.t. logp on a batch "
                                 f"with nonzero advantages{where}; the policy would never learn")


@check("rlmix_clip", "edge")
def _clip_edge(s: Subject) -> None:
    """No NaN or inf in the loss or its gradient on the edge batches."""
    run = s.shared()
    for what, _, batch in edge_batches(run):
        _advantages(run, batch)
        terms, value, logp, entropy = _clip(run, batch)
        if not torch.isfinite(value.detach()).all():
            bad = _finite_rows(terms.loss)
            where = (f"the per-token loss is {_nan_word(terms.loss)} at {_at(bad)}"
                     if bad else "LossTerms.extra is not finite")
            raise ConformanceFailure(f"rlmix_clip gave a {_nan_word(value)} loss on {what}: "
                                     f"{where}; NaN times a 0 mask is still NaN, so guard the "
                                     f"division (clamp counts to >= 1) or use torch.where")
        value.backward()
        for name, leaf in (("logp", logp), ("entropy", entropy)):
            if leaf.grad is not None and not torch.isfinite(leaf.grad).all():
                raise ConformanceFailure(f"the gradient of rlmix_clip's loss w.r.t. {name} is "
                                         f"NaN/inf on {what} ("
                                         f"{_at(_finite_rows(leaf.grad))}); a 0/0 hidden "
                                         f"behind torch.where still poisons the gradient: "
                                         f"clamp the denominator instead")


@check("rlmix_clip", "determinism", level="full")
def _clip_determinism(s: Subject) -> None:
    """Two fresh runs with the same seed give the same per-token loss."""
    losses = []
    for _ in range(2):
        run = s.run()
        batch = kit_batch(run)
        _advantages(run, batch)
        terms, _, _, _ = _clip(run, batch)
        losses.append(terms.loss.detach())
    if not torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-7, equal_nan=True):
        raise ConformanceFailure("rlmix_clip is not deterministic: two fresh runs with "
                                 "train.seed=0 give different losses on the same batch")


@check("rlmix_clip", "split", level="full")
def _clip_split(s: Subject) -> None:
    """Splitting a minibatch in two (same normalisers) leaves the loss and gradient unchanged."""
    run = s.shared()
    batch = kit_batch(run)
    _advantages(run, batch)
    with _stale(run, batch):
        _clip_split_on(run, batch)


def _clip_split_on(run: Run, batch: RolloutBatch) -> None:
    norm = _normalizers(run, batch)
    _, full, logp, _ = _clip(run, batch, norm)
    full.backward()
    half = len(batch) // 2
    total, grads = 0.0, []
    for rows in (list(range(half)), list(range(half, len(batch)))):
        part = batch.select(rows)
        _, value, part_logp, _ = _clip(run, part, norm)
        value.backward()
        total += float(value.detach())
        grads.append(part_logp.grad if part_logp.grad is not None
                     else torch.zeros_like(part_logp))
    if not math.isclose(float(full.detach()), total, rel_tol=1e-4, abs_tol=1e-6):
        raise ConformanceFailure(f"splitting a minibatch in two changes the loss "
                                 f"({float(full.detach()):.6g} whole vs {total:.6g} summed over "
                                 f"halves): a row's loss must not depend on the other rows of its "
                                 f"minibatch (train.grad_accum and PPO mini-batches split "
                                 f"batches): no normalising by the minibatch's own counts (the "
                                 f"core divides by mb.normalizers) and no minibatch statistics "
                                 f"such as quantiles (compute them over the whole batch, e.g. "
                                 f"in rlmix_advantage, and carry them in batch.extras)")
    if logp.grad is not None and not torch.allclose(logp.grad, torch.cat(grads), rtol=1e-4,
                                                    atol=1e-6):
        raise ConformanceFailure("splitting a minibatch in two changes the gradient w.r.t. "
                                 "logp; per-token losses must not depend on other rows of the "
                                 "minibatch (compute batch-level statistics in "
                                 "rlmix_advantage)")


# ---------------------------------------------------------------------------- rlmix_sample


@check("rlmix_sample", "batch")
def _sample_batch(s: Subject) -> None:
    """run.sample(prompts) returns a well-formed RolloutBatch (len(prompts) * group_size rows
    for an owner) that the core can score."""
    run = s.shared()
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    with torch.no_grad():
        batch = run.sample(prompts)
    problems = _batch_problems(batch, "rlmix_sample")
    if problems:
        raise ConformanceFailure("; ".join(problems))
    expected = len(prompts) * int(run.config.train.group_size)
    if s.owns("rlmix_sample") and len(batch) != expected:
        raise ConformanceFailure(f"rlmix_sample returned {len(batch)} rows for {len(prompts)} "
                                 f"prompts; expected {expected} = len(prompts) * "
                                 f"train.group_size")
    if len(batch) == 0:
        raise ConformanceFailure("rlmix_sample returned an empty batch")
    loop.score(run, batch)


@check("rlmix_sample", "determinism", level="full")
def _sample_determinism(s: Subject) -> None:
    """Two fresh runs with the same seed sample the same tokens."""
    tokens = []
    for _ in range(2):
        run = s.run()
        prompts = run.hook.rlmix_prompts(run=run, step=0)
        with torch.no_grad():
            tokens.append(run.sample(prompts).tokens)
    if _same(tokens[0], tokens[1]):
        raise ConformanceFailure("rlmix_sample is not deterministic: two fresh runs with "
                                 "train.seed=0 sample different tokens")


# ---------------------------------------------------------------------------- rlmix_generate


def _generate(run: Run, prompts: list[Prompt], n: int, temperature: float,
              max_new_tokens: int = 5) -> RolloutBatch:
    request = GenerationRequest(prompts=prompts, n=n, temperature=temperature,
                                max_new_tokens=max_new_tokens)
    with torch.no_grad():
        batch = run.hook.rlmix_generate(run=run, request=request)
    if batch is None:
        raise ConformanceFailure("rlmix_generate returned None")
    return batch


@check("rlmix_generate", "batch", owner_only=True)
def _generate_batch(s: Subject) -> None:
    """A well-formed batch: n rows per prompt, prompt-major, at most max_new_tokens completion
    tokens, the run's policy_version, behaviour log-probs <= 0 on completions and 0 elsewhere."""
    run = s.shared()
    prompts = run.hook.rlmix_prompts(run=run, step=0)[:2]
    n, limit = 3, 5
    batch = _generate(run, prompts, n, 1.0, limit)
    problems = _batch_problems(batch, "rlmix_generate")
    if problems:
        raise ConformanceFailure("; ".join(problems))
    expected = len(prompts) * n
    if len(batch) != expected:
        raise ConformanceFailure(f"rlmix_generate returned {len(batch)} rows for "
                                 f"{len(prompts)} prompts x n={n}; expected {expected}")
    want = torch.arange(len(prompts)).repeat_interleave(n)
    if not torch.equal(batch.group.cpu().long(), want):
        raise ConformanceFailure(f"rlmix_generate returned group {batch.group.tolist()}; expected "
                                 f"{want.tolist()} (the prompt index, rows prompt-major)")
    for i, p in enumerate(batch.prompts):
        if p is not prompts[i // n] and p != prompts[i // n]:
            raise ConformanceFailure(f"rlmix_generate row {i} carries prompt {p!r}; expected "
                                     f"request.prompts[{i // n}] (rows are prompt-major)")
    lengths = batch.completion_mask.sum(-1)
    if (lengths > limit).any():
        row = int((lengths > limit).nonzero()[0])
        raise ConformanceFailure(f"rlmix_generate row {row} has {int(lengths[row])} completion "
                                 f"tokens; request.max_new_tokens is {limit}")
    if (batch.policy_version != run.policy_version).any():
        raise ConformanceFailure(f"rlmix_generate returned policy_version "
                                 f"{batch.policy_version.tolist()}; expected run.policy_version "
                                 f"({run.policy_version}) on every row")


@check("rlmix_generate", "behavior_logp", owner_only=True)
def _generate_logp(s: Subject) -> None:
    """behavior_logp equals the policy's log-probs of the sampled tokens (temperature applied)."""
    for temperature in (1.0, 0.7):
        run = s.run([f"sampling.temperature={temperature}"])
        prompts = run.hook.rlmix_prompts(run=run, step=0)[:2]
        batch = _generate(run, prompts, 2, temperature, 6)
        assert run.policy is not None
        with torch.no_grad():
            logp, _ = run.policy.logprobs(run, batch)
        cmask = batch.completion_mask > 0
        if not cmask.any():
            continue
        diff = (logp.float().cpu() - batch.behavior_logp.float().cpu()).abs() * cmask
        if float(diff.max()) > 2e-2:
            row, col = (int(i) for i in (diff == diff.max()).nonzero()[0])
            raise ConformanceFailure(f"rlmix_generate's behavior_logp differs from the policy's "
                                     f"log-prob of the sampled token by {float(diff.max()):.3g} "
                                     f"at temperature {temperature} (row {row}, column {col}); "
                                     f"record log_softmax(logits / temperature) of each sampled "
                                     f"token")


@check("rlmix_generate", "determinism", owner_only=True)
def _generate_greedy(s: Subject) -> None:
    """Greedy generation (temperature 0) gives the same tokens twice."""
    run = s.shared()
    prompts = run.hook.rlmix_prompts(run=run, step=0)[:2]
    a = _generate(run, prompts, 1, 0.0, 5).tokens
    b = _generate(run, prompts, 1, 0.0, 5).tokens
    if _same(a, b):
        raise ConformanceFailure("rlmix_generate at temperature 0 (greedy) gave different "
                                 "tokens for the same prompts; temperature 0 means argmax")


@check("rlmix_generate", "seeded", level="full", owner_only=True)
def _generate_seeded(s: Subject) -> None:
    """Two fresh runs with the same seed sample the same tokens at temperature 1."""
    tokens = []
    for _ in range(2):
        run = s.run()
        prompts = run.hook.rlmix_prompts(run=run, step=0)[:2]
        tokens.append(_generate(run, prompts, 2, 1.0, 5).tokens)
    if _same(tokens[0], tokens[1]):
        raise ConformanceFailure("rlmix_generate is not deterministic under train.seed: two "
                                 "fresh runs sample different tokens; sample with torch's "
                                 "global generator (seeded by the core) or one seeded from "
                                 "run.config.train.seed")


# ---------------------------------------------------------------------------- rlmix_prompts


def _prompt_key(prompts: list[Prompt]) -> list[tuple[str, str]]:
    return [(json.dumps(p.messages, sort_keys=True), repr(p.answer)) for p in prompts]


@check("rlmix_prompts", "prompts", owner_only=True)
def _prompts(s: Subject) -> None:
    """train.prompts_per_step Prompt objects whose messages are [{role, content}] strings."""
    run = s.run(["train.prompts_per_step=3"])
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    if not isinstance(prompts, list):
        raise ConformanceFailure(f"rlmix_prompts returned {type(prompts).__name__}; expected a "
                                 f"list of rlmix.Prompt")
    if len(prompts) != 3:
        raise ConformanceFailure(f"rlmix_prompts returned {len(prompts)} prompts with "
                                 f"train.prompts_per_step=3; return exactly "
                                 f"run.config.train.prompts_per_step")
    for i, p in enumerate(prompts):
        if not isinstance(p, Prompt):
            raise ConformanceFailure(f"rlmix_prompts item {i} is {type(p).__name__}; expected "
                                     f"rlmix.Prompt")
        ok = isinstance(p.messages, list) and p.messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in p.messages)
        if not ok:
            raise ConformanceFailure(f"rlmix_prompts item {i} has messages {p.messages!r}; "
                                     f"expected a non-empty list of {{'role': str, 'content': "
                                     f"str}}")


@check("rlmix_prompts", "resume", owner_only=True)
def _prompts_resume(s: Subject) -> None:
    """The same prompts in a fresh run with the same seed, and after a resume (run.rng and
    run.state restored) as in an uninterrupted run."""
    straight = s.run()
    expected = []
    for step in range(3):
        straight.step = step
        expected.append(_prompt_key(straight.hook.rlmix_prompts(run=straight, step=step)))
    first = s.run()
    first.step = 0
    if _prompt_key(first.hook.rlmix_prompts(run=first, step=0)) != expected[0]:
        raise ConformanceFailure("rlmix_prompts is not deterministic: two fresh runs with "
                                 "train.seed=0 give different prompts at step 0; derive them "
                                 "from run.rng, run.config.train.seed and the step")
    snapshot = io.BytesIO()
    torch.save(first.state, snapshot)
    snapshot.seek(0)
    resumed = s.run()
    resumed.rng.setstate(first.rng.getstate())
    resumed.state.clear()
    resumed.state.update(torch.load(snapshot, weights_only=False))
    for step in (1, 2):
        resumed.step = step
        if _prompt_key(resumed.hook.rlmix_prompts(run=resumed, step=step)) != expected[step]:
            raise ConformanceFailure(f"rlmix_prompts(step={step}) after a resume differs from "
                                     f"an uninterrupted run; a resumed run would train on other "
                                     f"prompts: derive them from the step, run.rng or run.state, "
                                     f"never from module-level state or call counts")


# ---------------------------------------------------------------------------- rlmix_score


def _score(s: Subject, run: Run, batch: RolloutBatch, what: str) -> dict[str, torch.Tensor]:
    impl = s.impl(run, "rlmix_score")
    result = impl.function(run=run, batch=batch)
    if result is None:
        return {}
    if not isinstance(result, dict):
        raise ConformanceFailure(f"rlmix_score returned {type(result).__name__}{what}; expected "
                                 f"{{term: Tensor[N]}} or None")
    out = {}
    for term, value in result.items():
        if not isinstance(term, str) or not term:
            raise ConformanceFailure(f"rlmix_score returned a term named {term!r}; term names "
                                     f"are non-empty strings (the core prefixes '{s.name}.')")
        try:
            t = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
        except Exception as exc:  # noqa: BLE001
            raise ConformanceFailure(f"rlmix_score term '{term}' is not numeric{what} "
                                     f"({type(exc).__name__}: {exc})") from None
        if t.shape[0] != len(batch):
            raise ConformanceFailure(f"rlmix_score term '{term}' has {t.shape[0]} values for "
                                     f"{len(batch)} samples{what}; return one per row")
        bad = _finite_rows(t)
        if bad:
            raise ConformanceFailure(f"rlmix_score term '{term}' is {_nan_word(t)} at "
                                     f"{_at(bad)}{what}")
        out[term] = t
    return out


@check("rlmix_score", "terms")
def _score_terms(s: Subject) -> None:
    """{term: Tensor[N]} of finite numbers, also on a single-token and an empty completion."""
    run = s.shared()
    _score(s, run, kit_batch(run), "")
    for what, _, batch in edge_batches(run)[1:]:
        _score(s, run, batch, f" on {what}")


@check("rlmix_score", "determinism", level="full")
def _score_determinism(s: Subject) -> None:
    """Two fresh runs with the same seed score the same batch the same."""
    outs = []
    for _ in range(2):
        run = s.run()
        outs.append(_score(s, run, kit_batch(run), ""))
    if _same(outs[0], outs[1]):
        raise ConformanceFailure("rlmix_score is not deterministic: two fresh runs with "
                                 "train.seed=0 give different terms on the same batch")


# ---------------------------------------------------------------------------- other hooks


@check("rlmix_evaluate", "metrics")
def _evaluate(s: Subject) -> None:
    """{metric: number} (finite) or None, under no_grad with the model in eval mode."""
    run = s.shared()
    assert run.policy is not None
    impl = s.impl(run, "rlmix_evaluate")
    run.policy.model.eval()
    try:
        with torch.no_grad():
            result = impl.function(run=run)
    finally:
        run.policy.model.train()
    if result is None:
        return
    if not isinstance(result, dict):
        raise ConformanceFailure(f"rlmix_evaluate returned {type(result).__name__}; expected "
                                 f"{{metric: number}} or None")
    for key, value in result.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConformanceFailure(f"rlmix_evaluate metric '{key}' = {value!r} is not a "
                                     f"number") from None
        if not math.isfinite(number):
            raise ConformanceFailure(f"rlmix_evaluate metric '{key}' is {number}")


@check("rlmix_evolve", "update")
def _evolve(s: Subject) -> None:
    """None or a HarnessUpdate of text components, which the core can apply."""
    run = s.shared()
    batch = kit_batch(run)
    impl = s.impl(run, "rlmix_evolve")
    result = impl.function(run=run, batch=batch)
    if result is None:
        return
    if not isinstance(result, HarnessUpdate):
        raise ConformanceFailure(f"rlmix_evolve returned {type(result).__name__}; expected "
                                 f"rlmix.HarnessUpdate or None")
    bad = {k: type(v).__name__ for k, v in result.components.items()
           if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise ConformanceFailure(f"rlmix_evolve returned components that are not text: {bad}")
    loop.apply_harness_update(run, result)
    run.hook.rlmix_prompts(run=run, step=run.step)


@check("rlmix_update", "step")
def _update_step(s: Subject) -> None:
    """An optimizer step bumps policy_version by one, changes the weights, clears gradients,
    and returns numeric stats."""
    run = s.run()
    assert run.policy is not None
    before = [p.detach().clone() for p in run.policy.model.parameters()]
    metrics = _step(s, run)
    if run.policy_version != 1:
        raise ConformanceFailure(f"after one optimizer step run.policy_version is "
                                 f"{run.policy_version}; rlmix_update must increment it by one "
                                 f"on the minibatch with loss.minibatch.last")
    if all(torch.equal(a, p.detach()) for a, p in zip(before, run.policy.model.parameters())):
        raise ConformanceFailure("rlmix_update did not change the policy's weights on an "
                                 "optimizer step")
    stale = [n for n, p in run.policy.model.named_parameters()
             if p.grad is not None and bool((p.grad != 0).any())]
    if stale:
        raise ConformanceFailure(f"rlmix_update left gradients in .grad after the optimizer "
                                 f"step ({stale[0]}, ...); zero them so the next step does not "
                                 f"accumulate them")
    del metrics


@check("rlmix_update", "nan")
def _update_nan(s: Subject) -> None:
    """A NaN loss skips the optimizer step: weights and policy_version untouched."""
    run = s.run(probes={standins.POISON: standins.Poison})
    assert run.policy is not None
    before = [p.detach().clone() for p in run.policy.model.parameters()]
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the core's skipped-step warning
            loop.train_step(run)
    except Exception as exc:  # noqa: BLE001
        raise ConformanceFailure(f"rlmix_update raised on a NaN loss ({type(exc).__name__}: "
                                 f"{exc}); skip the step and carry on") from None
    changed = not all(torch.equal(a, p.detach())
                      for a, p in zip(before, run.policy.model.parameters()))
    if changed or run.policy_version != 0:
        raise ConformanceFailure("rlmix_update stepped on a NaN loss; when the loss or the "
                                 "gradient is not finite, skip the optimizer step and leave the "
                                 "weights and run.policy_version untouched")


@check("rlmix_update", "accumulation", level="full")
def _update_accumulation(s: Subject) -> None:
    """With train.grad_accum=2 one optimizer step is taken (on the last minibatch), and it
    moves the weights as the unsplit step does."""
    runs = []
    for accum in (1, 2):
        run = s.run([f"train.grad_accum={accum}"])
        _step(s, run)
        runs.append(run)
    if runs[1].policy_version != 1:
        raise ConformanceFailure(f"with train.grad_accum=2 one update bumped policy_version to "
                                 f"{runs[1].policy_version}; step the optimizer only when "
                                 f"loss.minibatch.last is True")
    lr = float(runs[0].config.train.lr)
    for (name, a), b in zip(runs[0].policy.model.named_parameters(),  # type: ignore[union-attr]
                            runs[1].policy.model.parameters()):  # type: ignore[union-attr]
        if not torch.allclose(a, b, rtol=1e-4, atol=4 * lr):
            raise ConformanceFailure(f"gradient accumulation over 2 minibatches moves {name} "
                                     f"differently from the unsplit update; accumulate "
                                     f"gradients and step once, on loss.minibatch.last")


@check("rlmix_token_logprobs", "matches_torch", owner_only=True)
def _token_logprobs(s: Subject) -> None:
    """(logp, entropy) [n, t] equal the plain torch computation (values and gradients), with the
    sampling temperature applied, also for n = t = 1."""
    from rlmix.policy import plain_token_logprobs

    for temperature in (1.0, 0.7):
        run = s.run([f"sampling.temperature={temperature}"])
        for n, t in ((3, 7), (1, 1)):
            g = torch.Generator().manual_seed(n * 100 + t)
            hidden = torch.randn(n, t, 16, generator=g)
            head = torch.nn.Linear(16, 50, bias=False)
            with torch.no_grad():
                head.weight.copy_(torch.randn(50, 16, generator=g) * 0.5)
            labels = torch.randint(0, 50, (n, t), generator=g)
            weights = torch.randn(2, n, t, generator=g)
            results = []
            for fn in ("plugin", "torch"):
                h = hidden.clone().requires_grad_(True)
                head.zero_grad()
                if fn == "plugin":
                    out = run.hook.rlmix_token_logprobs(run=run, hidden=h, lm_head=head,
                                                        labels=labels)
                    if not isinstance(out, tuple) or len(out) != 2:
                        raise ConformanceFailure(f"rlmix_token_logprobs returned "
                                                 f"{type(out).__name__}; expected (logp, "
                                                 f"entropy)")
                else:
                    out = plain_token_logprobs(h, head, labels, temperature)
                logp, entropy = out
                for name, value in (("logp", logp), ("entropy", entropy)):
                    if tuple(value.shape) != (n, t):
                        raise ConformanceFailure(f"rlmix_token_logprobs returned {name} of "
                                                 f"shape {_shape(value)}; expected {(n, t)} = "
                                                 f"labels.shape")
                ((logp.float() * weights[0]).sum() + (entropy.float() * weights[1]).sum()
                 ).backward()
                results.append((logp.detach().float(), entropy.detach().float(),
                                h.grad.clone(), head.weight.grad.clone()))
            names = ("logp", "entropy", "the gradient w.r.t. hidden",
                     "the gradient w.r.t. lm_head.weight")
            for name, ours, ref in zip(names, results[0], results[1]):
                if not torch.allclose(ours, ref, rtol=1e-4, atol=1e-4):
                    err = float((ours - ref).abs().max())
                    raise ConformanceFailure(f"rlmix_token_logprobs: {name} differs from the "
                                             f"plain torch computation by {err:.3g} at "
                                             f"temperature {temperature} (n={n}, t={t}); divide "
                                             f"the logits by run.config.sampling.temperature")


# ---------------------------------------------------------------------------- running


def plan(subject: Subject, level: str = "quick") -> list[Check]:
    """The checks that apply to ``subject`` at ``level``."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}")
    levels = LEVELS[:LEVELS.index(level) + 1]
    out = []
    for chk in CHECKS:
        if chk.level not in levels:
            continue
        if chk.hook and not subject.implements(chk.hook):
            continue
        if chk.hook and chk.owner_only and not subject.owns(chk.hook):
            continue
        out.append(chk)
    return out


def run_check(subject: Subject, chk: Check) -> Result:
    start = time.perf_counter()
    if subject.load_error:
        return Result(subject.name, chk.id, False, subject.load_error)
    if chk.needs_run and chk.id != "plugin/configure" and subject.cache.get("configure_error"):
        return Result(subject.name, chk.id, True, "not run: no run configures with this plugin "
                      "(see plugin/configure)", skipped=True)
    py_state = random.getstate()  # runs seed the global RNGs: leave the caller's as they were
    try:
        with torch.random.fork_rng():
            chk.fn(subject)
    except NotApplicable as exc:
        return Result(subject.name, chk.id, True, str(exc), skipped=True,
                      seconds=time.perf_counter() - start)
    except ConformanceFailure as exc:
        return Result(subject.name, chk.id, False, str(exc),
                      seconds=time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - the plugin's own error, reported with its place
        hook = chk.hook or "the plugin"
        return Result(subject.name, chk.id, False,
                      f"{hook} raised {type(exc).__name__}: {exc}{_where_raised(exc, subject)}",
                      seconds=time.perf_counter() - start)
    finally:
        random.setstate(py_state)
    return Result(subject.name, chk.id, True, seconds=time.perf_counter() - start)


def check_plugin(name: str, obj: Any = None, level: str = "quick") -> Report:
    """Run every applicable check on plugin ``name`` (installed, or ``obj`` in this process)."""
    subject = Subject(name, obj)
    report = Report(name)
    try:
        if subject.load_error:
            report.results.append(Result(name, "plugin/registers", False, subject.load_error))
            return report
        for chk in plan(subject, level):
            report.results.append(run_check(subject, chk))
    finally:
        subject.close()
    return report


def assert_conformant(name: str, obj: Any = None, level: str = "full") -> None:
    """``check_plugin`` that raises ``AssertionError`` listing every failure."""
    report = check_plugin(name, obj, level)
    if not report.ok:
        raise AssertionError(report.format())


__all__ = ["CHECKS", "Check", "ConformanceFailure", "LEVELS", "NotApplicable", "Report",
           "Result", "Subject", "assert_conformant", "check_plugin", "edge_batches",
           "kit_batch", "plan", "run_check"]
