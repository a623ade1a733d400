"""Checks that need more than a schema, run before any model loads: the plugins as a set
(ambiguous combinations, required companions, a group-relative advantage with groups of one,
score weights), the model's context and a memory estimate, the device.

What a plugin may declare (module or class attributes, all optional):

* ``RLMIX_GROUP_RELATIVE``: ``True`` (or a function of the plugin's ``Settings`` returning a
  bool) when its ``rlmix_advantage`` compares the completions of one prompt with each other;
  owning ``rlmix_advantage``, it then needs ``train.group_size >= 2``.
* ``RLMIX_REQUIRES``: ``{hook: "what it is for"}``, hooks another listed plugin must
  implement (``ray``: ``{"rlmix_generate": "a rollout engine for its workers, e.g. hf"}``).
* ``RLMIX_SCORE_TERMS``: the reward terms its ``rlmix_score`` returns, so ``score.weights``
  naming another term fails here (otherwise it fails at the first scored step).
* ``RLMIX_STANDIN``: ``True`` for a test stand-in registered beside the plugin under test (the
  conformance kit's fake env): it never counts as a second env.

Every problem is a ``ManifestError`` naming the key path, the value and what is allowed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pluggy

from rlmix import plugins as plugin_loading
from rlmix.errors import ManifestError
from rlmix.manifest import CoreConfig

GROUP_RELATIVE = "RLMIX_GROUP_RELATIVE"
REQUIRES = "RLMIX_REQUIRES"
SCORE_TERMS = "RLMIX_SCORE_TERMS"


def check(core: CoreConfig, pm: pluggy.PluginManager, settings: dict[str, Any]) -> None:
    """Every check of this module, in the order a user would fix them."""
    check_combination(pm, core.plugins)
    check_companions(pm, core.plugins)
    check_score_weights(pm, core)
    if core.train.mode != "harness-only":
        check_group_size(pm, core, settings)
    check_device(core)
    check_sizes(core)


def _plugin(pm: pluggy.PluginManager, name: str) -> Any:
    return pm.get_plugin(name)


def _implements(pm: pluggy.PluginManager, name: str, hook: str) -> bool:
    return any(n == name and not w for n, w in plugin_loading.implementers(pm, hook))


def check_combination(pm: pluggy.PluginManager, names: list[str]) -> None:
    """Two plugins that each bring prompts and score them are two envs: one would own the
    prompts and both would score them, which no manifest means."""
    envs = [n for n in names
            if _implements(pm, n, "rlmix_prompts") and _implements(pm, n, "rlmix_score")
            and not getattr(_plugin(pm, n), "RLMIX_STANDIN", False)]
    if len(envs) > 1:
        owner = next((n for n, w in plugin_loading.implementers(pm, "rlmix_prompts")
                      if not w), envs[-1])
        raise ManifestError(
            f"manifest error at 'plugins': {', '.join(repr(e) for e in envs)} each provide "
            f"prompts and score them (two envs); '{owner}' would own the prompts and all of "
            f"them would score them; list one env")


def check_companions(pm: pluggy.PluginManager, names: list[str]) -> None:
    for name in names:
        needs = getattr(_plugin(pm, name), REQUIRES, None) or {}
        for hook, purpose in needs.items():
            others = [n for n, w in plugin_loading.implementers(pm, hook)
                      if not w and n != name and not n.startswith(plugin_loading.CORE + ".")]
            if not others:
                offer = [p for p in plugin_loading.providers_of(hook) if p != name]
                raise ManifestError(
                    f"manifest error at 'plugins': '{name}' needs {purpose} (a plugin "
                    f"implementing {hook}), and none is listed; installed plugins that "
                    f"provide it: {', '.join(offer) or 'none'}")


def _weights(tree: Any, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in (tree or {}).items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(_weights(value, path))
        else:
            flat[path] = value
    return flat


def check_score_weights(pm: pluggy.PluginManager, core: CoreConfig) -> None:
    """``score.weights`` is ``{plugin: {term: number}}``: the plugin a listed scorer, the
    weight a finite number, the term one that plugin declares (when it declares its terms)."""
    scorers = [n for n, w in plugin_loading.implementers(pm, "rlmix_score") if not w]
    for path, value in _weights(core.score.weights).items():
        where = f"manifest error at 'score.weights.{path}'"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ManifestError(f"{where}: {value!r} is not a number; a weight is a number "
                                f"(0 turns the term off)")
        if not math.isfinite(float(value)):
            raise ManifestError(f"{where}: {value!r} is not allowed; a weight must be finite")
        plugin = next((s for s in sorted(scorers, key=len, reverse=True)
                       if path.startswith(s + ".")), None)
        if path in scorers:
            raise ManifestError(f"{where}: weights are given per term, "
                                f"score.weights.{path}.<term>: <number>")
        if plugin is None:
            raise ManifestError(f"{where}: '{path.split('.')[0]}' is not a listed plugin that "
                                f"scores; weights are score.weights.<plugin>.<term> with "
                                f"<plugin> one of: {', '.join(scorers) or 'none listed'}")
        term = path[len(plugin) + 1:]
        declared = getattr(_plugin(pm, plugin), SCORE_TERMS, None)
        if declared is not None and term not in declared:
            raise ManifestError(f"{where}: plugin '{plugin}' returns no reward term "
                                f"'{term}'; its terms: {', '.join(declared)}")


def group_relative(plugin: Any, settings: Any) -> bool:
    declared = getattr(plugin, GROUP_RELATIVE, False)
    return bool(declared(settings) if callable(declared) else declared)


def check_group_size(pm: pluggy.PluginManager, core: CoreConfig,
                     settings: dict[str, Any]) -> None:
    owner = next((n for n, w in plugin_loading.implementers(pm, "rlmix_advantage") if not w),
                 None)
    if owner is None or core.train.group_size >= 2:
        return
    if group_relative(_plugin(pm, owner), settings.get(owner)):
        raise ManifestError(
            f"manifest error at 'train.group_size': {core.train.group_size} is not allowed "
            f"with '{owner}', which owns rlmix_advantage and compares the completions of a "
            f"prompt with each other (a group of one has advantage 0); must be >= 2")


def check_device(core: CoreConfig) -> None:
    if core.policy.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ManifestError("manifest error at 'policy.device': 'cuda' is not available "
                                "here (torch sees no CUDA device); use auto or cpu")


# --------------------------------------------------------------------- sizes and memory

# tiny-random (rlmix.policy.tiny_random): 256 byte tokens + 4 specials
_TINY = {"context": 512, "hidden": 64, "intermediate": 128, "layers": 2, "vocab": 260,
         "tied": True}
# SmolLM2-135M-Instruct's config.json, used before its folder is first de-quantised
_SMOLLM2 = {"context": 8192, "hidden": 576, "intermediate": 1536, "layers": 30,
            "vocab": 49152, "tied": True}


def _from_config(path: Path) -> dict[str, Any] | None:
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    c = c.get("text_config", c)
    try:
        return {"context": int(c.get("max_position_embeddings") or c.get("n_positions") or 0),
                "hidden": int(c["hidden_size"]),
                "intermediate": int(c.get("intermediate_size") or 4 * int(c["hidden_size"])),
                "layers": int(c["num_hidden_layers"]), "vocab": int(c["vocab_size"]),
                "tied": bool(c.get("tie_word_embeddings", True))}
    except (KeyError, TypeError, ValueError):
        return None


def model_shape(name: str) -> dict[str, Any] | None:
    """The model's context and sizes from its config alone (no weights loaded); None when it
    cannot be known before loading. Raises for a name that cannot be loaded at all."""
    from rlmix import policy

    if name == "tiny-random":
        return dict(_TINY)
    if name == "smollm2-135m":
        cached = policy.cache_dir() / "models" / "smollm2-135m-instruct" / "config.json"
        return _from_config(cached) or dict(_SMOLLM2)
    if name in policy.ALIASES:
        return None
    folder = Path(name)
    if folder.exists():
        return _from_config(folder / "config.json") if folder.is_dir() else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers brings it
        return None
    found = try_to_load_from_cache(name, "config.json")
    if not isinstance(found, str):
        raise ManifestError(
            f"manifest error at 'model': {name!r} is neither an alias "
            f"({', '.join(policy.ALIASES)}), a local folder, nor a Hugging Face id already on "
            f"disk (nothing is downloaded)")
    return _from_config(Path(found))


def machine_memory(device: str) -> tuple[int, str]:
    """Bytes of memory the run can use and what they are (``"RAM"``, ``"GPU memory"``)."""
    import torch

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return int(torch.cuda.get_device_properties(0).total_memory), "GPU memory"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's limit, when smaller than the machine
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return int(total), "RAM"


def memory_estimate(core: CoreConfig, shape: dict[str, Any]) -> int:
    """A lower bound of a step's peak memory in bytes: the weights, AdamW's two moments and the
    gradients, the training forward's logits over the completion tokens of one accumulation
    chunk (kept for the backward, with their log-softmax), and one decoding step's logits for
    every row. Prompt tokens and activations come on top, so exceeding the machine with this
    bound is certain failure; it is only used to refuse such manifests."""
    t, s = core.train, core.sampling
    h, v, layers = shape["hidden"], shape["vocab"], shape["layers"]
    params = v * h * (1 if shape["tied"] else 2) + layers * (4 * h * h + 3 * h *
                                                              shape["intermediate"])
    width = 2 if core.policy.dtype in ("bfloat16", "float16") else 4
    rows = t.prompts_per_step * t.group_size
    chunk = math.ceil(rows / max(1, t.updates_per_epoch * t.grad_accum))
    training = core.train.mode != "harness-only"
    state = params * width + (params * (8 + width) if training else 0)
    logits = chunk * s.max_new_tokens * v * 4 * 2 if training else 0
    decode = rows * v * 4
    return state + logits + decode


def check_sizes(core: CoreConfig) -> None:
    shape = model_shape(core.model)
    if shape is None:
        return
    s, t = core.sampling, core.train
    context = shape["context"]
    if context and s.max_new_tokens >= context:
        raise ManifestError(
            f"manifest error at 'sampling.max_new_tokens': {s.max_new_tokens} does not fit "
            f"the context of model '{core.model}' ({context} tokens, prompt included); must be "
            f"< {context}")
    need = memory_estimate(core, shape)
    have, what = machine_memory(core.policy.device)
    if need > have:
        defaults = {"train.group_size": (t.group_size, 8),
                    "train.prompts_per_step": (t.prompts_per_step, 2),
                    "sampling.max_new_tokens": (s.max_new_tokens, 32)}
        key = max(defaults, key=lambda k: defaults[k][0] / defaults[k][1])
        gib = 2 ** 30
        raise ManifestError(
            f"manifest error at '{key}': {defaults[key][0]} needs at least "
            f"{need / gib:.0f} GiB ({t.prompts_per_step} prompts x {t.group_size} completions "
            f"x {s.max_new_tokens} tokens with model '{core.model}'), more than this machine's "
            f"{have / gib:.0f} GiB of {what}; lower train.group_size, train.prompts_per_step "
            f"or sampling.max_new_tokens, or raise train.grad_accum")
