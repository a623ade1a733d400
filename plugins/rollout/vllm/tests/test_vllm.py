"""Tests of the vLLM rollout plugin. vLLM needs a CUDA GPU and is an optional extra, so here
only the pure parts run: the sampling-parameter mapping, the batch assembly from vLLM-shaped
outputs (a fake engine), the settings checks and the missing-vLLM error. The engine itself
(log-probs against the trainer's, the weight push, throughput) is checked by gpu/vllm.sh."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import rlmix_vllm
import torch
from rlmix_vllm import Engine, Settings, assemble, sampling_kwargs

import rlmix
from rlmix.testing import make_run
from rlmix.types import GenerationRequest, Prompt

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_CUDA = torch.cuda.is_available()


def _request(**kw):
    return GenerationRequest(prompts=[Prompt(messages=[])], **kw)


def test_sampling_params_follow_the_request():
    kw = sampling_kwargs(_request(n=4, temperature=0.7, top_p=0.9, top_k=20,
                                  max_new_tokens=16), [5, 7])
    assert kw["n"] == 4 and kw["temperature"] == 0.7 and kw["top_p"] == 0.9
    assert kw["top_k"] == 20 and kw["max_tokens"] == 16
    assert kw["logprobs"] == 0  # the sampled token's log-prob, nothing more
    assert kw["stop_token_ids"] == [5, 7] and kw["ignore_eos"] is False
    assert "seed" not in kw


def test_greedy_and_no_top_k_map_to_vllm_conventions():
    kw = sampling_kwargs(_request(temperature=0.0, top_p=0.5, top_k=3), [], seed=11)
    assert kw["temperature"] == 0.0 and kw["top_p"] == 1.0 and kw["top_k"] == -1
    assert kw["ignore_eos"] is True and "seed" not in kw  # greedy needs no seed
    assert sampling_kwargs(_request(top_k=0), [1])["top_k"] == -1
    assert sampling_kwargs(_request(), [1], seed=3)["seed"] == 3


@dataclass
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[dict[int, object]] = field(default_factory=list)


def _output(completions):
    outs = []
    for tokens, logps in completions:
        entries = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logps)]
        outs.append(FakeCompletion(tokens, entries))
    return SimpleNamespace(outputs=outs)


def test_batch_assembly_pads_masks_and_keeps_logprobs_prompt_major():
    prompts = [Prompt(messages=[], id="a"), Prompt(messages=[], id="b")]
    prompt_ids = [[10, 11, 12], [20]]
    outputs = [_output([([1, 2], [-0.5, -1.0]), ([3], [-2.0])]),
               _output([([4, 5, 6], [-0.1, -0.2, -0.3]), ([], [])])]
    batch = assemble(prompt_ids, outputs, prompts, n=2, pad_id=0, version=7)
    # 3 prompt columns (left-padded) + 3 completion columns (right-padded)
    assert batch.tokens.tolist() == [[10, 11, 12, 1, 2, 0], [10, 11, 12, 3, 0, 0],
                                     [0, 0, 20, 4, 5, 6], [0, 0, 20, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0],
                                             [0, 0, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0]]
    assert batch.completion_mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 0, 0],
                                              [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]]
    expected = torch.zeros(4, 6)
    expected[0, 3:5] = torch.tensor([-0.5, -1.0])
    expected[1, 3] = -2.0
    expected[2, 3:6] = torch.tensor([-0.1, -0.2, -0.3])
    torch.testing.assert_close(batch.behavior_logp, expected)
    assert batch.group.tolist() == [0, 0, 1, 1]
    assert [p.id for p in batch.prompts] == ["a", "a", "b", "b"]
    assert batch.policy_version.tolist() == [7] * 4


def test_batch_assembly_reads_the_sampled_tokens_logprob_among_several():
    comp = FakeCompletion([9], [{3: SimpleNamespace(logprob=-0.1), 9: -4.0}])
    batch = assemble([[1]], [SimpleNamespace(outputs=[comp])], [Prompt(messages=[])], 1, 0, 0)
    assert float(batch.behavior_logp[0, 1]) == -4.0


def test_batch_assembly_rejects_missing_logprobs_and_wrong_counts():
    with pytest.raises(RuntimeError, match="log-probs"):
        assemble([[1]], [SimpleNamespace(outputs=[FakeCompletion([2], [])])],
                 [Prompt(messages=[])], 1, 0, 0)
    with pytest.raises(RuntimeError, match="asked for 2"):
        assemble([[1]], [_output([([2], [-1.0])])], [Prompt(messages=[])], 2, 0, 0)


class FakeLLM:
    """Records what the plugin asks of vllm.LLM."""

    def __init__(self):
        self.calls = []

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, fn, args=()):
        self.calls.append(("collective_rpc", fn.__name__))
        # what a worker would do: load into a model with load_weights
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.model))
        return [fn(worker, *args)]


class RecordingModel(torch.nn.Linear):
    def load_weights(self, weights):
        got = dict(weights)
        self.load_state_dict(got)
        return set(got)


def test_weight_push_and_sleep_cycle_on_a_fake_engine():
    llm = FakeLLM()
    llm.model = RecordingModel(3, 2)
    engine = Engine(llm=llm, settings=Settings(sleep_level=2), folder=None)  # type: ignore[arg-type]
    source = torch.nn.Linear(3, 2)
    engine.sleep()
    assert engine.asleep and not engine.has_weights  # level 2 dropped the weights
    engine.wake(["weights"])
    engine.push(source)
    assert engine.has_weights
    torch.testing.assert_close(llm.model.weight, source.weight)
    assert llm.calls == [("reset_prefix_cache",), ("sleep", 2), ("wake_up", ("weights",)),
                         ("collective_rpc", "_load_weights"), ("reset_prefix_cache",)]
    engine.settings = Settings(sleep_level=1)
    engine.sleep()
    assert engine.has_weights  # level 1 keeps them (in CPU memory)


@pytest.mark.parametrize("override, word", [("vllm.tensor_parallel_size=0", "tensor_parallel"),
                                            ("vllm.sleep_level=3", "sleep_level"),
                                            ("vllm.dtype=int8", "dtype"),
                                            ("vllm.gpu_memory_utilization=1.5", "gpu_memory")])
def test_bad_settings_fail_naming_the_setting(override, word):
    with pytest.raises(rlmix.ManifestError, match=word):
        make_run({"vllm": rlmix_vllm}, [override])


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_is_a_clear_error():
    run = make_run({"vllm": rlmix_vllm}, with_policy=True)
    with pytest.raises(rlmix.ConfigError, match=r"rlmix-vllm\[engine\]"):
        rlmix_vllm.rlmix_configure(run)


@pytest.mark.skipif(not (HAS_VLLM and HAS_CUDA),
                    reason="vLLM needs a CUDA GPU and the vllm package (extra rlmix-vllm[engine]);"
                           " this machine has neither: gpu/vllm.sh checks the engine on a GPU")
def test_engine_generates_with_trainer_logprobs():  # pragma: no cover - GPU only
    run = make_run({"vllm": rlmix_vllm}, ["vllm.enforce_eager=true"], with_policy=True)
    rlmix_vllm.rlmix_configure(run)
    batch = run.generate([Prompt(messages=[{"role": "user", "content": "hi"}])], n=2,
                         temperature=1.0, max_new_tokens=8)
    logp, _ = run.policy.logprobs(run, batch)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(logp[mask].cpu(), batch.behavior_logp[mask], atol=2e-2, rtol=0)
