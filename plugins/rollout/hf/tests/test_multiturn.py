"""Multi-turn rollouts through the env interface (``rlmix_episode`` / ``rlmix.types.Episode``).

A scripted sampler pins the exact token layout and masks; the real ``tiny-random`` model shows
that the behaviour log-probs of every model token equal the trainer's ``Policy.logprobs`` over
the whole row (so the row is exactly what the model saw, turn after turn)."""

from __future__ import annotations

import string

import pytest
import rlmix_hf
import torch

import rlmix
from rlmix.testing import make_run
from rlmix.types import Episode, GenerationRequest, Prompt, StepResult

TOOL_CALL = "Let me use the tool. <tool>calculator: 12*7</tool>"


class Calc(Episode):
    """Answers a tool call with a fixed result; an answer ends the episode; anything else gets
    a nudge from the user."""

    stop_strings = ("</tool>", "</answer>")

    def __init__(self, prompt: Prompt, result: str = "84") -> None:
        self.prompt = prompt
        self.result = result
        self.seen: list[str] = []

    def reset(self) -> list[dict[str, str]]:
        return self.prompt.messages

    def step(self, assistant_text: str) -> StepResult:
        self.seen.append(assistant_text)
        if "<tool>" in assistant_text:
            return StepResult(messages=[{"role": "tool", "content": self.result}],
                              info={"call": assistant_text.split("<tool>")[-1]})
        if "<answer>" in assistant_text or "answer is" in assistant_text:
            return StepResult(done=True, info={"final": assistant_text})
        return StepResult(messages=[{"role": "user", "content": "Use a tool or answer."}])


class EnvPlugin:
    """An env plugin offering ``episode_cls`` for prompts whose id starts with ``multi``."""

    def __init__(self, episode_cls=Calc, **kwargs) -> None:
        self.episode_cls, self.kwargs, self.made = episode_cls, kwargs, []

    @rlmix.hookimpl
    def rlmix_episode(self, run, prompt):
        if not prompt.id.startswith("multi"):
            return None
        episode = self.episode_cls(prompt, **self.kwargs)
        self.made.append(episode)
        return episode


def prompts(*ids):
    return [Prompt(messages=[{"role": "user", "content": f"task {pid}"}], id=pid)
            for pid in ids]


def scripted_sampler(tok, script):
    """A stand-in for ``sample_tokens`` that emits, for each row, the next scripted turn of the
    prompt named in the row's context (``script[prompt_id]`` is a list of turn texts; a turn
    ending in ``<EOS>`` emits the EOS token). It honours ``stop_fn``, EOS and ``max_new_tokens``
    exactly as the real sampler does; log-probs are -0.01 * (1 + position in the turn)."""
    turn_of: dict[str, int] = {}
    calls = []

    def fake(model, ids, attn, n, max_new_tokens, temperature, top_p, top_k, eos_ids, pad_id,
             generator=None, autocast=None, stop_fn=None):
        calls.append({"ids": ids.clone(), "attn": attn.clone(), "n": n})
        wanted = []
        for row in range(ids.shape[0]):
            context = tok.decode(ids[row][attn[row].bool()])
            pid = next(p for p in script if f"task {p}<" in context)
            k = turn_of.get(pid, 0)
            for _ in range(n):
                text = script[pid][k]
                eos = text.endswith("<EOS>")
                seq = tok(text.removesuffix("<EOS>"), add_special_tokens=False)["input_ids"]
                wanted.append(seq + ([tok.eos_token_id] if eos else []))
            turn_of[pid] = k + 1
        rows = len(wanted)
        done = torch.zeros(rows, dtype=torch.bool)
        toks, masks, logps = [], [], []
        for t in range(max_new_tokens):
            live = ~done
            choice = torch.tensor([w[t] if t < len(w) else pad_id for w in wanted])
            tok_t = torch.where(live, choice, torch.full_like(choice, pad_id))
            toks.append(tok_t)
            masks.append(live.float())
            logps.append(torch.where(live, torch.full((rows,), -0.01 * (t + 1)),
                                     torch.zeros(rows)))
            ran_out = torch.tensor([t + 1 >= len(w) for w in wanted])
            done = done | torch.isin(choice, torch.tensor(eos_ids))
            if stop_fn is not None:
                done = done | (live & stop_fn(tok_t, live))
            done = done | ran_out  # the script has no more tokens for this turn
            if bool(done.all()):
                break
        return torch.stack(toks, 1), torch.stack(masks, 1), torch.stack(logps, 1)

    return fake, calls


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_scripted_tool_call_then_answer_has_the_exact_layout(monkeypatch):
    env = EnvPlugin()
    run = make_run({"hf": rlmix_hf, "env": env}, with_policy=True)
    tok = run.tokenizer
    # the first turn runs past the tool call's end tag: the stop string cuts it there
    script = {"multi-a": [TOOL_CALL + " and more text", "The answer is 84.<EOS>"],
              "multi-b": ["<answer>5</answer> trailing"]}
    fake, calls = scripted_sampler(tok, script)
    monkeypatch.setattr(rlmix_hf, "sample_tokens", fake)
    batch = run.generate(prompts("multi-a", "multi-b"), n=1, max_new_tokens=200)

    opening = [run.policy.chat_text(p.messages) for p in prompts("multi-a", "multi-b")]
    width = max(len(ids_of(tok, t)) for t in opening)
    turn1 = ids_of(tok, TOOL_CALL)
    inserted = ids_of(tok, "<|im_end|>\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n")
    turn2 = ids_of(tok, "The answer is 84.") + [tok.eos_token_id]
    row_a = turn1 + inserted + turn2
    row_b = ids_of(tok, "<answer>5</answer>")
    assert batch.tokens.shape == (2, width + len(row_a))
    assert batch.tokens[0, width:].tolist() == row_a
    assert batch.tokens[1, width:width + len(row_b)].tolist() == row_b
    assert (batch.tokens[1, width + len(row_b):] == tok.pad_token_id).all()
    # the completion mask is 1 on both model turns, 0 on the template + tool result span
    mask_a = [1.0] * len(turn1) + [0.0] * len(inserted) + [1.0] * len(turn2)
    assert batch.completion_mask[0, width:].tolist() == mask_a
    assert batch.completion_mask[1, width:].tolist() == [1.0] * len(row_b) + [0.0] * (
        len(row_a) - len(row_b))
    assert (batch.completion_mask[:, :width] == 0).all()
    # attention covers prompt, turns and tool tokens; padding only
    assert batch.attention_mask[0].sum() == len(ids_of(tok, opening[0])) + len(row_a)
    assert batch.attention_mask[1, width:].tolist() == [1] * len(row_b) + [0] * (
        len(row_a) - len(row_b))
    # behaviour log-probs: the sampler's on model tokens (per turn), 0 on the inserted span
    expect = ([-0.01 * (i + 1) for i in range(len(turn1))] + [0.0] * len(inserted)
              + [-0.01 * (i + 1) for i in range(len(turn2))])
    torch.testing.assert_close(batch.behavior_logp[0, width:], torch.tensor(expect))
    # turn 2 was prefilled with exactly the row so far (prompt + turn 1 + inserted tokens)
    assert len(calls) == 2 and calls[1]["ids"].shape[0] == 1
    second = calls[1]["ids"][0][calls[1]["attn"][0].bool()].tolist()
    assert second == ids_of(tok, opening[0]) + turn1 + inserted
    # the episode saw each turn's text; info records the turns and why the episode ended
    a, b = env.made
    assert a.seen == [TOOL_CALL, "The answer is 84."] and b.seen == ["<answer>5</answer>"]
    ep = batch.info[0]["episode"]
    assert ep["stop_reason"] == "done" and [t["end"] for t in ep["turns"]] == ["stop", "eos"]
    assert ep["turns"][0]["messages"] == [{"role": "tool", "content": "84"}]
    assert ep["turns"][0]["info"] == {"call": "calculator: 12*7</tool>"}
    assert ep["model_tokens"] == len(turn1) + len(turn2) and ep["env_tokens"] == len(inserted)
    assert ep["model_text"] == TOOL_CALL + "The answer is 84."
    assert batch.texts[0] == tok.decode(row_a)
    assert batch.info[1]["episode"]["stop_reason"] == "done"


def test_a_turn_ended_by_eos_is_closed_once(monkeypatch):
    """A turn that ends with the model's EOS (the template's end-of-turn tag) but does not end
    the episode: the inserted span starts after the EOS, never repeating it."""
    run = make_run({"hf": rlmix_hf, "env": EnvPlugin()}, with_policy=True)
    tok = run.tokenizer
    fake, _ = scripted_sampler(tok, {"multi-c": ["hmm<EOS>", "<answer>1</answer>"]})
    monkeypatch.setattr(rlmix_hf, "sample_tokens", fake)
    batch = run.generate(prompts("multi-c"), max_new_tokens=200)
    width = len(ids_of(tok, run.policy.chat_text(prompts("multi-c")[0].messages)))
    nudge = ids_of(tok, "\n<|im_start|>user\nUse a tool or answer.<|im_end|>\n"
                        "<|im_start|>assistant\n")
    turn1 = ids_of(tok, "hmm") + [tok.eos_token_id]
    turn2 = ids_of(tok, "<answer>1</answer>")
    assert batch.tokens[0, width:].tolist() == turn1 + nudge + turn2
    assert batch.completion_mask[0, width:].tolist() == (
        [1.0] * len(turn1) + [0.0] * len(nudge) + [1.0] * len(turn2))
    assert [t["end"] for t in batch.info[0]["episode"]["turns"]] == ["eos", "stop"]


def test_turn_limit_and_token_budget(monkeypatch):
    run = make_run({"hf": rlmix_hf, "env": EnvPlugin()}, ["hf.max_turns=2"], with_policy=True)
    tok = run.tokenizer
    fake, _ = scripted_sampler(tok, {"multi-a": [TOOL_CALL] * 3})
    monkeypatch.setattr(rlmix_hf, "sample_tokens", fake)
    batch = run.generate(prompts("multi-a"), max_new_tokens=200)
    ep = batch.info[0]["episode"]
    assert ep["stop_reason"] == "max_turns" and len(ep["turns"]) == 2
    # nothing is appended after the last turn: the row ends on a model token
    last = int(batch.attention_mask[0].nonzero().max())
    assert batch.completion_mask[0, last] == 1
    # a budget of model tokens over all turns cuts the second turn short
    budget = len(ids_of(tok, TOOL_CALL)) + 5
    run = make_run({"hf": rlmix_hf, "env": EnvPlugin()}, with_policy=True)
    fake, _ = scripted_sampler(tok, {"multi-a": [TOOL_CALL] * 3})
    monkeypatch.setattr(rlmix_hf, "sample_tokens", fake)
    batch = run.generate(prompts("multi-a"), max_new_tokens=budget)
    ep = batch.info[0]["episode"]
    assert ep["stop_reason"] == "max_new_tokens" and ep["turns"][-1]["end"] == "budget"
    assert batch.completion_mask.sum() == budget == ep["model_tokens"]
    # max_episode_tokens caps model + env tokens: the tool result no longer fits
    run = make_run({"hf": rlmix_hf, "env": EnvPlugin()}, ["hf.max_episode_tokens=60"],
                   with_policy=True)
    fake, _ = scripted_sampler(tok, {"multi-a": [TOOL_CALL] * 3})
    monkeypatch.setattr(rlmix_hf, "sample_tokens", fake)
    batch = run.generate(prompts("multi-a"), max_new_tokens=200)
    ep = batch.info[0]["episode"]
    assert ep["stop_reason"] == "max_episode_tokens"
    assert batch.attention_mask[0].sum() - len(ids_of(tok, run.policy.chat_text(
        prompts("multi-a")[0].messages))) <= 60


class Chatty(Episode):
    """Ends a turn on any ASCII letter, answers with a tool message, finishes after 3 turns:
    on the random model this gives short turns, some ended by EOS, all re-prefilled."""

    stop_strings = tuple(string.ascii_letters)

    def __init__(self, prompt: Prompt) -> None:
        self.prompt, self.turns = prompt, 0

    def reset(self):
        return self.prompt.messages

    def step(self, assistant_text):
        self.turns += 1
        return StepResult(messages=[{"role": "tool", "content": f"result {self.turns}"}],
                          done=self.turns >= 3)


def sharpen(model, std=0.3, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_behaviour_logp_equals_the_trainers_forward_over_the_whole_row(temperature):
    """The trainer recomputes log-probs over the whole token row (prompt, model turns, tool
    messages); on model tokens they equal what the sampler recorded, turn after turn."""
    run = make_run({"hf": rlmix_hf, "env": EnvPlugin(Chatty)},
                   ["sampling.temperature=1.0", "hf.max_turns=4"], with_policy=True)
    sharpen(run.policy.model).eval()
    torch.manual_seed(3)
    ps = prompts("multi-0", "multi-1 longer", "plain")
    batch = run.hook.rlmix_generate(run=run, request=GenerationRequest(
        prompts=ps, n=2, temperature=temperature, max_new_tokens=30))
    assert batch.group.tolist() == [0, 0, 1, 1, 2, 2]
    turns = [len(i["episode"]["turns"]) for i in batch.info]
    assert max(turns) >= 2 and turns[4:] == [1, 1]  # "plain" has no episode: one turn
    region = batch.attention_mask.bool() & (batch.completion_mask == 0)
    width = int(batch.completion_mask.sum(0).nonzero()[0])
    assert region[:, width:].any()  # tool messages sit inside the completion region
    with torch.no_grad():
        logp, _ = run.policy.logprobs(run, batch)
    live = batch.completion_mask.bool()
    torch.testing.assert_close(batch.behavior_logp[live], logp[live], atol=1e-4, rtol=0)
    assert (batch.behavior_logp[~live] == 0).all()


def test_no_episode_leaves_single_turn_unchanged():
    """An env plugin that declines every prompt (returns None) changes nothing."""
    request = GenerationRequest(prompts=prompts("plain-a", "plain-b"), n=2, temperature=0.0,
                                max_new_tokens=8)
    plain = make_run({"hf": rlmix_hf}, with_policy=True)
    sharpen(plain.policy.model)
    with_env = make_run({"hf": rlmix_hf, "env": EnvPlugin()}, with_policy=True)
    sharpen(with_env.policy.model)
    a = plain.hook.rlmix_generate(run=plain, request=request)
    b = with_env.hook.rlmix_generate(run=with_env, request=request)
    for name in ("tokens", "attention_mask", "completion_mask", "behavior_logp"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.texts == b.texts and all("episode" not in i for i in b.info)


def test_an_episode_that_raises_stops_the_rollout_with_its_name(monkeypatch):
    class Broken(Calc):
        def step(self, assistant_text):
            raise ValueError("bug in the env")

    run = make_run({"hf": rlmix_hf, "env": EnvPlugin(Broken)}, with_policy=True)
    fake, _ = scripted_sampler(run.tokenizer, {"multi-a": [TOOL_CALL]})
    monkeypatch.setattr(rlmix_hf, "sample_tokens", fake)
    with pytest.raises(RuntimeError, match="Broken.step raised ValueError: bug in the env"):
        run.generate(prompts("multi-a"), max_new_tokens=64)


def test_bad_multi_turn_settings_fail():
    for bad in ("hf.max_turns=0", "hf.max_episode_tokens=-1"):
        with pytest.raises(rlmix.ManifestError, match="max_"):
            make_run({"hf": rlmix_hf}, [bad])
