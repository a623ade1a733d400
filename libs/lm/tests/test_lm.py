"""rlmix_lm: the HTTP chat-completions client against a real server on loopback (started here,
serving the tiny model), its retries, timeouts and errors; the local transformers model; the
policy through the run's rollout engine; and the manifest block."""

from __future__ import annotations

import socket

import pytest
import torch
from rlmix_lm import HTTPChatLM, LMError, LMSettings, PolicyLM, TransformersLM, make_lm
from rlmix_lm.chat_server import ChatServer

import rlmix
from rlmix.testing import make_batch, make_run


@pytest.fixture(scope="module")
def server():
    with ChatServer.tiny(max_tokens=16) as s:
        yield s


def test_http_client_gets_the_served_models_completion(server):
    lm = HTTPChatLM(server.base_url, "tiny-random", timeout_s=30)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+3?"}]
    reply = lm.complete(messages, max_new_tokens=8, temperature=0.0)
    # the same model in-process gives the same greedy text
    assert reply == server.lm.complete(messages, 8, 0.0)
    assert isinstance(reply, str)
    body = server.log[-1]
    assert body["messages"] == messages and body["max_tokens"] == 8
    assert lm.complete_batch(["a", "b"], max_new_tokens=4) == [
        server.lm.complete("a", 4), server.lm.complete("b", 4)]


def test_http_retries_with_backoff_then_succeeds():
    with ChatServer.tiny(fail_first=2) as s:
        lm = HTTPChatLM(s.base_url, "tiny-random", retries=3, backoff_s=0.01)
        assert lm.complete("hi", max_new_tokens=4) == s.lm.complete("hi", 4)
        assert lm.requests == 3 and s.requests == 3 and len(s.log) == 1


def test_http_gives_up_with_the_last_error():
    with ChatServer.tiny(fail_first=10) as s:
        lm = HTTPChatLM(s.base_url, "tiny-random", retries=1, backoff_s=0.01)
        with pytest.raises(LMError, match=r"HTTP 503.*gave up after 2 attempts"):
            lm.complete("hi")
        assert s.requests == 2


def test_http_wrong_key_fails_at_once():
    with ChatServer.tiny(api_key="sesame") as s:
        with pytest.raises(LMError, match="HTTP 401"):
            HTTPChatLM(s.base_url, "m", api_key="wrong", retries=3, backoff_s=0.01).complete("x")
        assert s.requests == 1  # a client error is not retried
        HTTPChatLM(s.base_url, "m", api_key="sesame").complete("x", 4)
        assert len(s.log) == 1 and s.requests == 2


def test_http_timeout_and_unreachable_server():
    with ChatServer.tiny(delay_s=1.0) as s:
        with pytest.raises(LMError, match="cannot reach"):
            HTTPChatLM(s.base_url, "m", timeout_s=0.2, retries=0).complete("x", 2)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(LMError, match=r"cannot reach .*gave up after 2 attempts"):
        HTTPChatLM(f"http://127.0.0.1:{port}/v1", "m", retries=1, backoff_s=0.01).complete("x")


def test_http_bad_reply_and_bounded_server(server):
    with pytest.raises(LMError, match="HTTP 404"):
        HTTPChatLM(server.base_url + "/nothing", "m", retries=0).complete("x")
    big = "x" * (server.max_body + 10)
    with pytest.raises(LMError, match="HTTP 413"):
        HTTPChatLM(server.base_url, "m", retries=0).complete(big)


def test_make_lm_reads_the_key_from_the_named_environment_variable(server, monkeypatch):
    run = make_run()
    settings = LMSettings(source="http", base_url=server.base_url, model="tiny-random",
                          api_key_env="RLMIX_TEST_KEY")
    monkeypatch.delenv("RLMIX_TEST_KEY", raising=False)
    with pytest.raises(LMError, match="RLMIX_TEST_KEY.*not set"):
        make_lm(run, settings, "gepa")
    monkeypatch.setenv("RLMIX_TEST_KEY", "k123")
    lm = make_lm(run, settings, "gepa")
    assert isinstance(lm, HTTPChatLM) and lm.api_key == "k123"


def test_local_model_by_alias_is_loaded_once():
    run = make_run()
    settings = LMSettings(source="local", model="tiny-random")
    lm = make_lm(run, settings)
    assert isinstance(lm, TransformersLM) and make_lm(run, settings) is lm
    a = lm.complete("hello", max_new_tokens=6)
    assert a == lm.complete("hello", max_new_tokens=6)  # greedy: repeatable
    sampled = lm.complete_batch(["hello", "hello"], max_new_tokens=6, temperature=1.0)
    assert len(sampled) == 2 and all(isinstance(t, str) for t in sampled)


class Recorder:
    requests: list = []

    @rlmix.hookimpl
    def rlmix_generate(self, run, request):
        Recorder.requests.append(request)
        batch = make_batch(n_groups=len(request.prompts), group_size=1)
        batch.texts = [f" reply {i} " for i in range(len(request.prompts))]
        return batch


def test_policy_lm_goes_through_the_rollout_engine():
    run = make_run({"recorder": Recorder()}, with_policy=True)
    run.policy.model.train()
    lm = PolicyLM(run)
    out = lm.complete_batch(["first", [{"role": "user", "content": "second"}]],
                            max_new_tokens=7, temperature=0.5)
    assert out == ["reply 0", "reply 1"]
    req = Recorder.requests[-1]
    assert [p.messages for p in req.prompts] == [[{"role": "user", "content": "first"}],
                                                 [{"role": "user", "content": "second"}]]
    assert (req.max_new_tokens, req.temperature, req.n) == (7, 0.5, 1)
    assert run.policy.model.training  # left as it was found


def test_policy_lm_without_an_engine_uses_the_model_directly():
    run = make_run(with_policy=True)
    direct = TransformersLM(run.policy.model, run.policy.tokenizer)
    with torch.no_grad():
        assert PolicyLM(run).complete("abc", 5) == direct.complete("abc", 5)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="lm: source"):
        LMSettings(source="cloud")
    with pytest.raises(ValueError, match="base_url"):
        LMSettings(source="http", base_url="localhost:8000")
    with pytest.raises(ValueError, match="model"):
        LMSettings(source="local")
    with pytest.raises(TypeError):
        HTTPChatLM("http://127.0.0.1:1/v1").complete([{"content": "no role"}])


def test_parse_verdict_is_strict_about_keys_and_types():
    from rlmix_lm import parse_verdict

    fields = {"flawed": bool}
    assert parse_verdict('text {"flawed": true} more', fields) == {"flawed": True}
    # the first object that fits wins; nested and later objects are searched too
    assert parse_verdict('{"x": 1} {"flawed": false}', fields) == {"flawed": False}
    assert parse_verdict('{"a": {"flawed": true}}', fields) == {"flawed": True}
    for reply in ("no json", '{"flawed": "yes"}', '{"flawed": ', "[true]", ""):
        assert parse_verdict(reply, fields) is None
    # a JSON boolean is not a number
    assert parse_verdict('{"score": true}', {"score": (int, float)}) is None
    assert parse_verdict('{"score": 0.5}', {"score": (int, float)}) == {"score": 0.5}
