"""The manifest: core schema, YAML loading, dotlist overrides, validation against plugin settings.

A manifest names plugins and holds one block per plugin (``dapo.clip_higher`` reads the block at
the config path ``dapo.clip_higher``). Core sections are typed dataclasses below; each plugin
declares a ``Settings`` dataclass. Everything is checked before any model loads, and every
problem is a ``ManifestError`` that names the plugin, the key path and the allowed choices.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from rlmix.errors import ManifestError

RANGE = "rlmix_range"  # dataclass field metadata key of a declared range


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric setting; ``why`` is added to the message when given."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is out of range (None when it is in range, or not a number)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        bounds = [(op, bound, test) for op, bound, test in (
            (">=", self.ge, operator.ge), (">", self.gt, operator.gt),
            ("<=", self.le, operator.le), ("<", self.lt, operator.lt)) if bound is not None]
        if value == value and all(test(value, bound) for _, bound, test in bounds):  # not NaN
            return None
        allowed = " and ".join(f"{op} {bound:g}" for op, bound, _ in bounds)
        return f"{value!r} is not allowed; must be {allowed}" + (f" ({self.why})" if self.why
                                                                   else "")


def setting(default: Any, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, why: str = "") -> Any:
    """A ``Settings`` (or core) field with a declared range, checked when the manifest is
    validated, before any model loads: ``eps_low: float = rlmix.setting(0.2, ge=0, lt=1)``.
    A value out of range is reported as ``manifest error at '<plugin>.eps_low' (plugin
    '<plugin>'): 1.5 is not allowed; must be >= 0 and < 1``."""
    return field(default=default, metadata={RANGE: Range(ge, gt, le, lt, why)})


def check_ranges(settings: Any) -> None:
    """Raise ``ValueError("<field>: ...")`` for the first field of a dataclass instance out of
    its declared range (for code that builds a ``Settings`` itself; the manifest checks the
    ranges on its own)."""
    for f in dataclasses.fields(settings):
        bounds = f.metadata.get(RANGE)
        problem = bounds.problem(getattr(settings, f.name)) if bounds else None
        if problem:
            raise ValueError(f"{f.name}: {problem}")


def _range_problem(cls: type, node: Any, prefix: str) -> tuple[str, str] | None:
    """(key path, problem) of the first value of ``node`` (a merged config of ``cls``) out of
    its declared range, nested dataclasses included."""
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        value = node.get(f.name) if isinstance(node, DictConfig) else None
        if dataclasses.is_dataclass(hints.get(f.name)) and isinstance(value, DictConfig):
            found = _range_problem(hints[f.name], value, path)
            if found:
                return found
        bounds = f.metadata.get(RANGE)
        problem = bounds.problem(value) if bounds is not None else None
        if problem:
            return path, problem
    return None


@dataclass
class TrainConfig:
    steps: int = setting(30, ge=0)
    prompts_per_step: int = setting(2, ge=1)
    group_size: int = setting(8, ge=1)
    lr: float = setting(1e-5, ge=0)
    weight_decay: float = setting(0.0, ge=0)
    adam_beta1: float = setting(0.9, ge=0, lt=1)
    adam_beta2: float = setting(0.999, ge=0, lt=1)
    max_grad_norm: float = setting(1.0, ge=0)
    warmup_steps: int = setting(0, ge=0)
    lr_schedule: str = "constant"  # after warm-up: constant | linear (decay to 0 at the last step)
    epochs: int = setting(1, ge=1)  # passes over each batch
    updates_per_epoch: int = setting(1, ge=1)  # optimizer steps per pass (PPO mini-batches)
    # forward/backward chunks accumulated into each optimizer step
    grad_accum: int = setting(1, ge=1)
    # step each parameter inside the backward and free its gradient (needs max_grad_norm 0)
    optimizer_in_backward: bool = False
    shuffle: bool = True
    # seq-mean-token-sum-norm divisor; 0 = max_new_tokens
    loss_norm_constant: float = setting(0.0, ge=0)
    seed: int = 0
    # policy versions a sample may lag the trainer; > 0 samples ahead in a background thread
    max_staleness: int = setting(0, ge=0, why="0 = synchronous sampling")  # 0 = synchronous
    eval_every: int = setting(10, ge=0)  # 0 = only at start and end
    checkpoint_every: int = setting(10, ge=0)  # 0 = only at the end
    keep_checkpoints: int = setting(2, ge=0)
    mode: str = "rl"  # rl | harness-only (no weight updates: each step evolves the harness)
    evolve_every: int = setting(1, ge=1)  # call rlmix_evolve every this many steps


@dataclass
class SamplingConfig:
    temperature: float = setting(1.0, gt=0, why="training samples need a temperature > 0; "
                                 "evaluation is greedy on its own")
    top_p: float = setting(1.0, gt=0, le=1)
    top_k: int = setting(0, ge=0)
    max_new_tokens: int = setting(32, ge=1)


@dataclass
class PolicyConfig:
    dtype: str = "float32"  # weights: float32 | bfloat16
    # compute: none | bfloat16 (mixed precision, weights stay in dtype) | float16 | auto
    # (bfloat16 where the device computes it natively, rlmix.policy.native_bf16; else none)
    autocast: str = "none"
    # with autocast: the LM head's matmul in the autocast dtype too (log-softmax stays fp32), as
    # TRL's bf16=True does; false: the LM head in fp32
    lm_head_autocast: bool = False
    threads: int = setting(0, ge=0)  # torch threads; 0 = torch's default
    device: str = "auto"  # auto | cpu | cuda
    gradient_checkpointing: bool = False
    share_prefix: bool = True  # run each group's prompt once in the training forward


@dataclass
class LogConfig:
    progress: bool = True
    tensorboard: bool = False
    plot: bool = True


@dataclass
class ScoreConfig:
    weights: dict[str, Any] = field(default_factory=dict)  # {plugin: {term: weight}}


@dataclass
class CoreConfig:
    model: str = "smollm2-135m"
    plugins: list[str] = field(default_factory=list)
    out: str = ""  # default runs/<manifest name>
    name: str = "run"
    train: TrainConfig = field(default_factory=TrainConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    log: LogConfig = field(default_factory=LogConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    harness: dict[str, str] = field(default_factory=dict)  # initial harness components


def check_choices(settings: Any, **choices: tuple[str, ...] | list[str]) -> None:
    """For a plugin's ``Settings.__post_init__``: each named field must be one of its choices.

    ``check_choices(self, scale=("group", "batch", "none"))`` raises
    ``ValueError("scale: 'grop' is not allowed; choose one of group, batch, none")``, which the
    manifest reports at the key path ``<plugin>.scale``."""
    for name, allowed in choices.items():
        value = getattr(settings, name)
        if value not in allowed:
            raise ValueError(f"{name}: {value!r} is not allowed; choose one of "
                             f"{', '.join(allowed)}")


CORE_KEYS = tuple(f.name for f in dataclasses.fields(CoreConfig))
_CHOICES = {"policy.dtype": ("float32", "bfloat16", "float16"),
            "policy.autocast": ("none", "bfloat16", "float16", "auto"),
            "policy.device": ("auto", "cpu", "cuda"),
            "train.mode": ("rl", "harness-only"),
            "train.lr_schedule": ("constant", "linear")}


def read(path: str | Path | None, overrides: list[str] | None = None) -> DictConfig:
    """Load YAML (or start empty) and apply ``key=value`` dotlist overrides. No validation."""
    cfg = OmegaConf.create({})
    name = "run"
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ManifestError(f"manifest not found: {p}")
        try:
            loaded = OmegaConf.load(p)
        except Exception as exc:  # yaml errors come in several types
            text = "; ".join(" ".join(line.split()) for line in str(exc).splitlines()
                             if line.strip())
            raise ManifestError(f"{p}: not valid YAML: {text}") from None
        if not isinstance(loaded, DictConfig):
            raise ManifestError(f"{p}: a manifest is a mapping of keys, got a list")
        cfg = loaded
        name = p.stem
    bad = [o for o in overrides or [] if "=" not in o]
    if bad:
        raise ManifestError(f"override {bad[0]!r} is not key=value")
    for item in overrides or []:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except Exception as exc:  # noqa: BLE001 - OmegaConf's and YAML's errors
            text = getattr(exc, "msg", None) or str(exc)
            first = " ".join(str(text).split("\n")[0].split())
            key, _, value = item.partition("=")
            node: Any = cfg
            parts = key.split(".")
            for i, part in enumerate(parts[:-1]):
                node = node.get(part) if isinstance(node, DictConfig) else None
                if node is not None and not isinstance(node, DictConfig):
                    where = ".".join(parts[:i + 1])
                    raise ManifestError(f"manifest error at '{where}': expected a mapping of "
                                        f"settings, got {_shown(node)} (override {item!r} "
                                        f"sets a key in it)") from None
            existing = node.get(parts[-1]) if isinstance(node, DictConfig) else None
            if isinstance(existing, DictConfig):
                raise ManifestError(f"manifest error at '{key}': expected a mapping of "
                                    f"settings, got {value} (override {item!r})") from None
            raise ManifestError(f"override {item!r}: the value {value!r} for '{key}' is not "
                                f"valid ({first}); a list is written [a,b], a string with "
                                f"commas or brackets is quoted") from None
    if "name" not in cfg:
        cfg.name = name
    return cfg  # type: ignore[return-value]


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(m.name for m in tp)
    return getattr(tp, "__name__", str(tp))


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def _structured_error(exc: OmegaConfBaseException, prefix: str, cls: type,
                      owner: str) -> ManifestError:
    key = str(getattr(exc, "full_key", None) or getattr(exc, "key", None) or "")
    path = f"{prefix}.{key}" if prefix and key else (prefix or key)
    who = f" (plugin '{owner}')" if owner else ""
    # walk to the dataclass that owns the key: to list its fields, or name the key's type
    parent = cls
    for part in key.split(".")[:-1]:
        hint = _field_types(parent).get(part)
        if dataclasses.is_dataclass(hint):
            parent = hint
    if isinstance(exc, ConfigKeyError):
        allowed = ", ".join(f.name for f in dataclasses.fields(parent))
        return ManifestError(f"manifest error at '{path}'{who}: unknown key; allowed keys: "
                             f"{allowed}")
    expected = _field_types(parent).get(key.split(".")[-1])
    detail = f"; expected {_type_name(expected)}" if expected is not None else ""
    value = getattr(exc, "msg", str(exc)).split("\n")[0]
    return ManifestError(f"manifest error at '{path}'{who}: {value}{detail}")


def validate_block(cls: type, block: Any, prefix: str, owner: str = "") -> Any:
    """Merge ``block`` into the structured config of ``cls`` and return a ``cls`` instance."""
    block = {} if block is None else block
    who = f" (plugin '{owner}')" if owner else ""
    if not isinstance(block, (dict, DictConfig)):
        raise ManifestError(f"manifest error at '{prefix}'{who}: expected a mapping of "
                            f"settings, got {_shown(block)}")
    _check_mappings(cls, block, prefix, who)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), block)
    except OmegaConfBaseException as exc:
        raise _structured_error(exc, prefix, cls, owner) from None
    found = _range_problem(cls, merged, prefix)
    if found:
        raise ManifestError(f"manifest error at '{found[0]}'{who}: {found[1]}")
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _structured_error(exc, prefix, cls, owner) from None
    except (ValueError, TypeError) as exc:  # raised by a Settings.__post_init__ check
        # "field: message" (the convention of the plugins' checks) names the key path itself
        text = str(exc)
        head, sep, rest = text.partition(":")
        names = {f.name for f in dataclasses.fields(cls)}
        if sep and head.strip() in names:
            name, text = head.strip(), rest.strip()
        else:  # "eps_high (0.1) must be >= eps_low": names its field first
            name = (text.split() or [""])[0].strip(":,")
        path = (f"{prefix}.{name}" if prefix else name) if name in names else prefix
        raise ManifestError(f"manifest error at '{path}' (plugin '{owner}'): {text}") from None


def _shown(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_mappings(cls: type, block: Any, prefix: str, who: str) -> None:
    """A nested section (``train``, ``sampling``, a dict-typed field) given as a scalar or a
    list is named here; OmegaConf's own error for it carries no key."""
    for name, hint in _field_types(cls).items():
        if name not in block:
            continue
        value = block[name]
        path = f"{prefix}.{name}" if prefix else name
        mapping = dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict
        if mapping and value is not None and not isinstance(value, (dict, DictConfig)):
            keys = (", ".join(f.name for f in dataclasses.fields(hint))
                    if dataclasses.is_dataclass(hint) else "")
            raise ManifestError(f"manifest error at '{path}'{who}: expected a mapping"
                                + (f" of settings ({keys})" if keys else "")
                                + f", got {_shown(value)}")
        if dataclasses.is_dataclass(hint) and isinstance(value, (dict, DictConfig)):
            _check_mappings(hint, value, path, who)
        if typing.get_origin(hint) is list and value is not None \
                and not isinstance(value, (list, ListConfig)):
            raise ManifestError(f"manifest error at '{path}'{who}: expected a list, got "
                                f"{_shown(value)}" + ("; write plugins: [hf, arith, grpo]"
                                                      if path == "plugins" else ""))


def validate_core(cfg: DictConfig) -> CoreConfig:
    core_part = {k: cfg[k] for k in CORE_KEYS if k in cfg}
    core = validate_block(CoreConfig, core_part, "", "")
    for path, choices in _CHOICES.items():
        section, key = path.split(".")
        value = getattr(getattr(core, section), key)
        if value not in choices:
            raise ManifestError(f"manifest error at '{path}': {value!r} is not allowed; "
                                f"choose one of {', '.join(choices)}")
    train = core.train
    if train.optimizer_in_backward and train.max_grad_norm > 0:
        raise ManifestError(f"manifest error at 'train.optimizer_in_backward': true needs "
                            f"train.max_grad_norm: 0 (it is {train.max_grad_norm}); each "
                            f"parameter is stepped before the global gradient norm is known")
    if train.optimizer_in_backward and train.grad_accum > 1:
        raise ManifestError(f"manifest error at 'train.optimizer_in_backward': true needs "
                            f"train.grad_accum: 1 (it is {train.grad_accum}); gradients are "
                            f"freed in the backward, so they cannot be accumulated")
    for key, value in core.harness.items():
        if not isinstance(value, str):
            raise ManifestError(f"manifest error at 'harness.{key}': a harness component is "
                                f"a text, got {_shown(value)}")
    if core.out and Path(core.out).exists() and not Path(core.out).is_dir():
        raise ManifestError(f"manifest error at 'out': {core.out!r} is a file; the run folder "
                            f"must be a folder (or not exist yet)")
    if not core.plugins:
        raise ManifestError("manifest error at 'plugins': no plugins listed; a training run "
                            "needs at least a rollout engine, an env and an algorithm, for "
                            "example plugins: [hf, arith, grpo]")
    return core


def validate_plugin_blocks(cfg: DictConfig, plugins: list[Any],
                           installed_names: set[str]) -> dict[str, Any]:
    """Check every non-core top-level key against the listed plugins' Settings.

    Returns ``{plugin name: Settings instance}`` (plugins without Settings are absent)."""
    listed = {p.name: p for p in plugins}
    roots: dict[str, set[str]] = {}
    for name in listed:
        parts = name.split(".")
        for i in range(1, len(parts)):
            roots.setdefault(".".join(parts[:i]), set()).add(parts[i])
    settings: dict[str, Any] = {}

    def check_node(path: str, node: Any) -> None:
        plugin = listed.get(path)
        cls = plugin.settings_cls if plugin is not None else None
        children = roots.get(path, set())
        own_fields = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
        who = f" (plugin '{plugin.name}')" if plugin else ""
        if isinstance(node, DictConfig):
            for key in node.keys():
                key = str(key)
                if key in children:
                    check_node(f"{path}.{key}", node[key])
                elif key not in own_fields:
                    allowed = sorted(own_fields | children)
                    hint = (f"; allowed keys: {', '.join(allowed)}" if allowed
                            else "; this plugin takes no settings")
                    raise ManifestError(f"manifest error at '{path}.{key}'{who}: unknown key"
                                        + hint)
        elif node is not None:
            raise ManifestError(f"manifest error at '{path}'{who}: expected a mapping of "
                                f"settings, got {_shown(node)}")
        if cls is not None:
            block = {k: node[k] for k in own_fields if isinstance(node, DictConfig) and k in node}
            settings[plugin.name] = validate_block(cls, block, path, plugin.name)

    for key in cfg.keys():
        key = str(key)
        if key in CORE_KEYS:
            continue
        if key in listed or key in roots:
            check_node(key, cfg[key])
            continue
        if key in installed_names:
            raise ManifestError(f"manifest error at '{key}': settings for plugin '{key}', which "
                                f"is not listed in 'plugins'; add it there or remove the block")
        allowed = sorted(set(CORE_KEYS) | set(listed) | set(roots))
        raise ManifestError(f"manifest error at '{key}': unknown key; allowed top-level keys: "
                            f"{', '.join(allowed)}")
    for name, plugin in listed.items():  # plugins whose block is absent get their defaults
        if plugin.settings_cls is not None and name not in settings:
            settings[name] = validate_block(plugin.settings_cls, {}, name, name)
    return settings


def resolved(cfg: DictConfig, core: CoreConfig, settings: dict[str, Any]) -> DictConfig:
    """The fully resolved manifest: core defaults and every plugin's defaults filled in."""
    out = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(core)))
    for name, value in settings.items():
        OmegaConf.update(out, name, OmegaConf.to_container(OmegaConf.structured(value)),
                         force_add=True)
    return out  # type: ignore[return-value]

