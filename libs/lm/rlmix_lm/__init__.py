"""The language model that reflects and proposes, behind one small interface.

Harness plugins (GEPA, ACE, ...) ask a model to read feedback and write new text. That model is
one of three things, chosen in the manifest by an ``LMSettings`` block nested in the plugin's
settings (``gepa: {lm: {source: http, ...}}``):

* ``policy``: the policy itself, in-process, through ``run.generate`` (the rollout engine), or
  the model and tokenizer directly when no engine is registered;
* ``local``: another local transformers model, by alias (``tiny-random``, ``smollm2-135m``),
  local folder, or Hugging Face id already on disk (``rlmix.policy.load_model``);
* ``http``: any OpenAI-compatible chat-completions server (base URL, model name, API key read
  from the environment variable the manifest names), with ``urllib`` only: timeouts, retries
  with exponential backoff on connection errors, 429 and 5xx, and clear errors otherwise.

Every model answers ``complete(prompt_or_messages, max_new_tokens, temperature) -> str`` and
``complete_batch([...], ...) -> list[str]``.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from rlmix.errors import RlmixError
from rlmix.manifest import check_choices

if TYPE_CHECKING:  # pragma: no cover
    from rlmix.types import Run

Messages = list[dict[str, str]]
SOURCES = ("policy", "local", "http")


class LMError(RlmixError):
    """The reflection model could not answer (server down, bad reply, missing key)."""


def as_messages(prompt: str | Messages) -> Messages:
    """A plain string becomes one user message; a chat is checked and returned as it is."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise TypeError("a prompt is a string or a list of {'role': ..., 'content': ...} dicts")
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


@runtime_checkable
class LM(Protocol):
    """What harness plugins call."""

    def complete(self, prompt: str | Messages, max_new_tokens: int = 256,
                 temperature: float = 0.0) -> str: ...

    def complete_batch(self, prompts: Sequence[str | Messages], max_new_tokens: int = 256,
                       temperature: float = 0.0) -> list[str]: ...


@dataclass
class LMSettings:
    """The manifest block of a reflection model (nest it in a plugin's ``Settings`` as ``lm``)."""

    source: str = "policy"  # policy | local | http
    model: str = ""  # local: alias / folder / HF id on disk; http: the served model's name
    base_url: str = ""  # http: e.g. http://127.0.0.1:8000/v1 (``/chat/completions`` is appended)
    api_key_env: str = ""  # http: NAME of the environment variable holding the key ("" = none)
    max_new_tokens: int = 256  # per reply
    temperature: float = 0.0  # 0 = greedy
    timeout_s: float = 60.0  # http: per request
    retries: int = 3  # http: extra attempts after a failed one
    backoff_s: float = 1.0  # http: first wait; doubles each retry

    def __post_init__(self) -> None:
        try:
            self._check()
        except ValueError as exc:  # "lm: key: why", so the manifest error names <plugin>.lm
            raise ValueError(f"lm: {exc}") from None

    def _check(self) -> None:
        check_choices(self, source=SOURCES)
        if self.source == "local" and not self.model:
            raise ValueError("model: source 'local' needs a model (alias, folder or HF id)")
        if self.source == "http" and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: source 'http' needs an http(s) URL, got "
                             f"{self.base_url!r}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens: must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature: must be >= 0")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s: must be > 0")
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError("retries: retries and backoff_s must be >= 0")


class _BatchByLoop:
    def complete(self, prompt: str | Messages, max_new_tokens: int = 256,
                 temperature: float = 0.0) -> str:
        return self.complete_batch([prompt], max_new_tokens, temperature)[0]

    def complete_batch(self, prompts: Sequence[str | Messages], max_new_tokens: int = 256,
                       temperature: float = 0.0) -> list[str]:
        return [self.complete(p, max_new_tokens, temperature) for p in prompts]


class TransformersLM(_BatchByLoop):
    """A transformers causal LM and its tokenizer, in-process (batched, left-padded)."""

    def __init__(self, model: Any, tokenizer: Any, seed: int = 0) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.generator_seed = seed

    @classmethod
    def load(cls, name: str, dtype: str = "float32") -> TransformersLM:
        from rlmix.policy import load_model

        model, tok = load_model(name, dtype)
        return cls(model.eval(), tok)

    @torch.no_grad()
    def complete_batch(self, prompts: Sequence[str | Messages], max_new_tokens: int = 256,
                       temperature: float = 0.0) -> list[str]:
        if not prompts:
            return []
        tok = self.tokenizer
        texts = [tok.apply_chat_template(as_messages(p), tokenize=False,
                                         add_generation_prompt=True) for p in prompts]
        old_side = tok.padding_side
        tok.padding_side = "left"
        try:
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            tok.padding_side = old_side
        device = next(self.model.parameters()).device
        enc = {k: v.to(device) for k, v in enc.items()}
        was_training = self.model.training
        self.model.eval()
        kwargs: dict[str, Any] = {"max_new_tokens": int(max_new_tokens),
                                  "pad_token_id": tok.pad_token_id,
                                  "eos_token_id": tok.eos_token_id}
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
            torch.manual_seed(self.generator_seed)
            self.generator_seed += 1
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        try:
            out = self.model.generate(**enc, **kwargs)
        finally:
            self.model.train(was_training)
        new = out[:, enc["input_ids"].shape[1]:]
        return [t.strip() for t in tok.batch_decode(new, skip_special_tokens=True)]


class PolicyLM(_BatchByLoop):
    """The policy under training, through the run's rollout engine (``run.generate``)."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def complete_batch(self, prompts: Sequence[str | Messages], max_new_tokens: int = 256,
                       temperature: float = 0.0) -> list[str]:
        from rlmix.types import Prompt

        run = self.run
        if run.policy is None:
            raise LMError("lm source 'policy' needs the run's policy to be loaded")
        if not prompts:
            return []
        model = run.policy.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                if run.hook.rlmix_generate.get_hookimpls():
                    batch = run.generate([Prompt(messages=as_messages(p)) for p in prompts],
                                         temperature=temperature,
                                         max_new_tokens=max_new_tokens)
                    return [t.strip() for t in batch.texts]
                return TransformersLM(model, run.policy.tokenizer).complete_batch(
                    prompts, max_new_tokens, temperature)
        finally:
            model.train(was_training)


class HTTPChatLM(_BatchByLoop):
    """An OpenAI-compatible ``POST {base_url}/chat/completions`` client on ``urllib``."""

    def __init__(self, base_url: str, model: str = "", api_key: str | None = None,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 1.0) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key = model, api_key
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.requests = 0  # attempts made, for tests and logs

    def complete(self, prompt: str | Messages, max_new_tokens: int = 256,
                 temperature: float = 0.0) -> str:
        body = json.dumps({"model": self.model, "messages": as_messages(prompt),
                           "max_tokens": int(max_new_tokens),
                           "temperature": float(temperature)}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.requests += 1
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    raw = response.read()
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:300].decode(errors="replace")
                last = f"HTTP {exc.code} from {self.url}: {detail}"
                if exc.code == 429 or exc.code >= 500:
                    continue
                raise LMError(last) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                reason = getattr(exc, "reason", exc)
                last = f"cannot reach {self.url}: {reason}"
                continue
            return self._content(raw)
        raise LMError(f"{last} (gave up after {self.retries + 1} attempts)")

    def _content(self, raw: bytes) -> str:
        try:
            reply = json.loads(raw)
            content = reply["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise LMError(f"{self.url} did not answer with a chat completion: "
                          f"{raw[:200].decode(errors='replace')!r}") from None
        if not isinstance(content, str):
            raise LMError(f"{self.url}: message content is not text: {content!r}")
        return content.strip()


def make_lm(run: Run, settings: LMSettings, owner: str = "") -> LM:
    """The model ``settings`` names; ``local`` models are loaded once per run (kept in
    ``run.resources``). ``owner`` (the plugin name) is used in error messages."""
    where = f"{owner}.lm" if owner else "lm"
    if settings.source == "policy":
        return PolicyLM(run)
    if settings.source == "local":
        key = f"rlmix_lm.local:{settings.model}"
        if key not in run.resources:
            run.resources[key] = TransformersLM.load(settings.model)
        return run.resources[key]
    if settings.source == "http":
        key = None
        if settings.api_key_env:
            key = os.environ.get(settings.api_key_env)
            if not key:
                raise LMError(f"{where}.api_key_env: the environment variable "
                              f"{settings.api_key_env!r} is not set")
        return HTTPChatLM(settings.base_url, settings.model, key, settings.timeout_s,
                          settings.retries, settings.backoff_s)
    raise LMError(f"{where}.source: {settings.source!r} is not one of {', '.join(SOURCES)}")


def parse_verdict(reply: str, fields: dict[str, type | tuple[type, ...]]) -> dict[str, Any] | None:
    """The first JSON object in a judge's ``reply`` that has every key of ``fields`` with a value
    of the given type(s), or ``None`` (prose, truncated JSON, a missing key, a wrong type).

    Reward plugins that ask a model for a structured verdict call this and score a ``None`` as 0
    (and count it): the policy's text reaches the judge, so a reply is never trusted to parse.
    ``bool`` is not accepted where a number is asked for (JSON ``true`` is not a score)."""
    decoder = json.JSONDecoder()
    start = reply.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(reply, start)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and all(_has_type(value, k, t) for k, t in fields.items()):
            return value
        start = reply.find("{", start + 1)
    return None


def _has_type(value: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> bool:
    if key not in value:
        return False
    kinds = kind if isinstance(kind, tuple) else (kind,)
    item = value[key]
    if isinstance(item, bool) and bool not in kinds:
        return False
    return isinstance(item, kinds)
