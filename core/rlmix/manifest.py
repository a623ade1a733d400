"""The manifest: core schema, YAML loading, dotlist overrides, validation against plugin settings.

A manifest names plugins and holds one block per plugin (``dapo.clip_higher`` reads the block at
the config path ``dapo.clip_higher``). Core sections are typed dataclasses below; each plugin
declares a ``Settings`` dataclass. Everything is checked before any model loads, and every
problem is a ``ManifestError`` that names the plugin, the key path and the allowed choices.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from rlmix.errors import ManifestError


@dataclass
class TrainConfig:
    steps: int = 30
    prompts_per_step: int = 2
    group_size: int = 8
    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # after warm-up: constant | linear (decay to 0 at the last step)
    epochs: int = 1  # passes over each batch
    updates_per_epoch: int = 1  # optimizer steps per pass (PPO mini-batches)
    grad_accum: int = 1  # forward/backward chunks accumulated into each optimizer step
    # step each parameter inside the backward and free its gradient (needs max_grad_norm 0)
    optimizer_in_backward: bool = False
    shuffle: bool = True
    loss_norm_constant: float = 0.0  # seq-mean-token-sum-norm divisor; 0 = max_new_tokens
    seed: int = 0
    # policy versions a sample may lag the trainer; > 0 samples ahead in a background thread
    max_staleness: int = 0  # 0 = synchronous
    eval_every: int = 10  # 0 = only at start and end
    checkpoint_every: int = 10  # 0 = only at the end
    keep_checkpoints: int = 2
    mode: str = "rl"  # rl | harness-only (no weight updates: each step evolves the harness)
    evolve_every: int = 1  # call rlmix_evolve every this many steps


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32


@dataclass
class PolicyConfig:
    dtype: str = "float32"  # weights: float32 | bfloat16
    autocast: str = "none"  # compute: none | bfloat16 (mixed precision, weights stay in dtype)
    threads: int = 0  # torch threads; 0 = torch's default
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
            "policy.autocast": ("none", "bfloat16", "float16"),
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
            raise ManifestError(f"{p}: not valid YAML: {exc}") from None
        if not isinstance(loaded, DictConfig):
            raise ManifestError(f"{p}: a manifest is a mapping of keys, got a list")
        cfg = loaded
        name = p.stem
    bad = [o for o in overrides or [] if "=" not in o]
    if bad:
        raise ManifestError(f"override {bad[0]!r} is not key=value")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides or [])))
    except OmegaConfBaseException as exc:
        raise ManifestError(f"overrides: {exc.msg if hasattr(exc, 'msg') else exc}") from None
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
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or ""
    path = f"{prefix}.{key}" if prefix and key else (prefix or str(key))
    who = f" (plugin '{owner}')" if owner else ""
    if isinstance(exc, ConfigKeyError):
        # walk to the dataclass that owns the unknown key to list its fields
        parent = cls
        for part in str(key).split(".")[:-1]:
            hint = _field_types(parent).get(part)
            if dataclasses.is_dataclass(hint):
                parent = hint
        allowed = ", ".join(f.name for f in dataclasses.fields(parent))
        return ManifestError(f"manifest error at '{path}'{who}: unknown key; allowed keys: "
                             f"{allowed}")
    leaf = str(key).split(".")[-1]
    parent = cls
    for part in str(key).split(".")[:-1]:
        hint = _field_types(parent).get(part)
        if dataclasses.is_dataclass(hint):
            parent = hint
    expected = _field_types(parent).get(leaf)
    detail = f"expected {_type_name(expected)}" if expected is not None else ""
    value = getattr(exc, "msg", str(exc)).split("\n")[0]
    return ManifestError(f"manifest error at '{path}'{who}: {value}"
                         + (f"; {detail}" if detail else ""))


def validate_block(cls: type, block: Any, prefix: str, owner: str = "") -> Any:
    """Merge ``block`` into the structured config of ``cls`` and return a ``cls`` instance."""
    schema = OmegaConf.structured(cls)
    if block is None:
        block = {}
    if not isinstance(block, (dict, DictConfig)):
        raise ManifestError(f"manifest error at '{prefix}' (plugin '{owner}'): expected a "
                            f"mapping of settings, got {block!r}")
    try:
        merged = OmegaConf.merge(schema, block)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _structured_error(exc, prefix, cls, owner) from None
    except (ValueError, TypeError) as exc:  # raised by a Settings.__post_init__ check
        # "field: message" (the convention of the plugins' checks) names the key path itself
        text = str(exc)
        head, sep, rest = text.partition(":")
        names = {f.name for f in dataclasses.fields(cls)}
        path = prefix
        if sep and head.strip() in names:
            path, text = f"{prefix}.{head.strip()}" if prefix else head.strip(), rest.strip()
        raise ManifestError(f"manifest error at '{path}' (plugin '{owner}'): {text}") from None


def validate_core(cfg: DictConfig) -> CoreConfig:
    core_part = {k: cfg[k] for k in CORE_KEYS if k in cfg}
    core = validate_block(CoreConfig, core_part, "", "")
    for path, choices in _CHOICES.items():
        section, key = path.split(".")
        value = getattr(getattr(core, section), key)
        if value not in choices:
            raise ManifestError(f"manifest error at '{path}': {value!r} is not allowed; "
                                f"choose one of {', '.join(choices)}")
    if core.train.evolve_every < 1:
        raise ManifestError("manifest error at 'train.evolve_every': must be >= 1, got "
                            f"{core.train.evolve_every}")
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
        children = roots.get(path, set())
        own_fields: set[str] = set()
        if plugin is not None and plugin.settings_cls is not None:
            own_fields = {f.name for f in dataclasses.fields(plugin.settings_cls)}
        if isinstance(node, DictConfig):
            for key in node.keys():
                key = str(key)
                if key in children:
                    check_node(f"{path}.{key}", node[key])
                elif key not in own_fields:
                    allowed = sorted(own_fields | {c for c in children})
                    who = f" (plugin '{plugin.name}')" if plugin else ""
                    hint = (f"; allowed keys: {', '.join(allowed)}" if allowed
                            else "; this plugin takes no settings")
                    raise ManifestError(f"manifest error at '{path}.{key}'{who}: unknown key"
                                        + hint)
        elif node is not None and plugin is None:
            raise ManifestError(f"manifest error at '{path}': expected a mapping of settings")
        if plugin is not None and plugin.settings_cls is not None:
            block = {k: node[k] for k in own_fields if isinstance(node, DictConfig) and k in node}
            settings[plugin.name] = validate_block(plugin.settings_cls, block, path, plugin.name)

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
    out = OmegaConf.structured(core)
    out = OmegaConf.create(OmegaConf.to_container(out))
    for name, value in settings.items():
        OmegaConf.update(out, name, OmegaConf.to_container(OmegaConf.structured(value)),
                         force_add=True)
    return out  # type: ignore[return-value]


def to_yaml(cfg: DictConfig | ListConfig) -> str:
    return OmegaConf.to_yaml(cfg)
