"""Bad inputs, one table: every case must end in exactly one ``rlmix: error:`` line (exit 2)
naming what is wrong (each case asserts its words), with no traceback, and nothing may be
accepted silently. The count of cases is in the README's reliability section."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from rlmix import cli

from .conftest import EXAMPLE, TINY

# a run that would finish in seconds if a case were (wrongly) accepted
BASE = [*TINY, "train.steps=1", "train.eval_every=0", "log.plot=false"]


@dataclass
class Case:
    id: str
    overrides: list[str] = field(default_factory=list)
    expect: tuple[str, ...] = ()
    yaml: str | None = None  # a manifest of its own instead of the example
    argv: list[str] | None = None  # a whole command line ({out}, {manifest} filled in)
    skip: str = ""


# the example's blocks (grpo, arith) would be errors where a case lists other plugins
MINI = "model: tiny-random\nplugins: [hf, arith, grpo]\n"
NO_CUDA = "" if not torch.cuda.is_available() else "a CUDA device is present"

CASES = [
    # ranges of the core (declared with rlmix.setting)
    Case("steps-negative", ["train.steps=-1"], ("'train.steps'", "-1 is not allowed",
                                                ">= 0")),
    Case("group-size-0", ["train.group_size=0"], ("'train.group_size'", "0 is not allowed",
                                                  ">= 1")),
    Case("group-size-negative", ["train.group_size=-4"], ("'train.group_size'", "-4")),
    Case("prompts-per-step-0", ["train.prompts_per_step=0"], ("'train.prompts_per_step'",
                                                              "0 is not allowed")),
    Case("lr-negative", ["train.lr=-0.1"], ("'train.lr'", "-0.1 is not allowed", ">= 0")),
    Case("weight-decay-negative", ["train.weight_decay=-0.01"], ("'train.weight_decay'",)),
    Case("adam-beta1-1", ["train.adam_beta1=1.0"], ("'train.adam_beta1'", "1.0", "< 1")),
    Case("adam-beta2-negative", ["train.adam_beta2=-0.5"], ("'train.adam_beta2'", "-0.5")),
    Case("max-grad-norm-negative", ["train.max_grad_norm=-1"], ("'train.max_grad_norm'",)),
    Case("warmup-negative", ["train.warmup_steps=-1"], ("'train.warmup_steps'",)),
    Case("epochs-0", ["train.epochs=0"], ("'train.epochs'", "0 is not allowed", ">= 1")),
    Case("updates-per-epoch-0", ["train.updates_per_epoch=0"], ("'train.updates_per_epoch'",)),
    Case("grad-accum-0", ["train.grad_accum=0"], ("'train.grad_accum'",)),
    Case("loss-norm-constant-negative", ["train.loss_norm_constant=-1"],
         ("'train.loss_norm_constant'",)),
    Case("max-staleness-negative", ["train.max_staleness=-1"], ("'train.max_staleness'",
                                                                "synchronous")),
    Case("eval-every-negative", ["train.eval_every=-1"], ("'train.eval_every'",)),
    Case("checkpoint-every-negative", ["train.checkpoint_every=-1"],
         ("'train.checkpoint_every'", "-1 is not allowed")),
    Case("keep-checkpoints-negative", ["train.keep_checkpoints=-1"],
         ("'train.keep_checkpoints'",)),
    Case("evolve-every-0", ["train.evolve_every=0"], ("'train.evolve_every'", ">= 1")),
    Case("temperature-0", ["sampling.temperature=0"], ("'sampling.temperature'", "> 0",
                                                       "greedy")),
    Case("temperature-negative", ["sampling.temperature=-1"], ("'sampling.temperature'",)),
    Case("top-p-2", ["sampling.top_p=2.0"], ("'sampling.top_p'", "2.0 is not allowed", "<= 1")),
    Case("top-p-0", ["sampling.top_p=0"], ("'sampling.top_p'", "> 0")),
    Case("top-k-negative", ["sampling.top_k=-1"], ("'sampling.top_k'",)),
    Case("max-new-tokens-0", ["sampling.max_new_tokens=0"], ("'sampling.max_new_tokens'",
                                                             "0 is not allowed")),
    Case("threads-negative", ["policy.threads=-2"], ("'policy.threads'",)),
    # types and choices
    Case("steps-not-int", ["train.steps=abc"], ("'train.steps'", "abc", "int")),
    Case("max-new-tokens-not-int", ["sampling.max_new_tokens=ten"],
         ("'sampling.max_new_tokens'", "ten")),
    Case("seed-float", ["train.seed=1.5"], ("'train.seed'", "1.5")),
    Case("progress-not-bool", ["log.progress=maybe"], ("'log.progress'", "maybe")),
    Case("dtype-unknown", ["policy.dtype=float8"], ("'policy.dtype'", "'float8'",
                                                    "choose one of")),
    Case("autocast-unknown", ["policy.autocast=fp8"], ("'policy.autocast'", "'fp8'")),
    Case("device-unknown", ["policy.device=tpu"], ("'policy.device'", "'tpu'")),
    Case("mode-unknown", ["train.mode=offline"], ("'train.mode'", "'offline'")),
    Case("device-cuda-absent", ["policy.device=cuda"], ("'policy.device'", "not available"),
         skip=NO_CUDA),
    # structure
    Case("train-unknown-key", ["train.stepz=3"], ("'train.stepz'", "unknown key", "steps")),
    Case("top-level-unknown-key", ["bogus=1"], ("'bogus'", "unknown key")),
    Case("train-as-list", yaml="model: tiny-random\nplugins: [hf, arith, grpo]\ntrain: [1, 2]\n",
         expect=("'train'", "expected a mapping", "[1, 2]")),
    Case("sampling-as-list", yaml="model: tiny-random\nplugins: [hf, arith, grpo]\n"
                                  "sampling: [a]\n",
         expect=("'sampling'", "expected a mapping", "['a']")),
    Case("sampling-as-scalar", ["sampling=5"], ("'sampling'", "expected a mapping")),
    Case("plugins-as-string", ["plugins=hf"], ("'plugins'", "expected a list")),
    Case("plugin-block-as-list", ["grpo=[1]"], ("'grpo'", "expected a mapping", "[1]")),
    Case("plugin-block-as-list-in-yaml", yaml=MINI + "grpo: [1]\n",
         expect=("'grpo'", "plugin 'grpo'", "expected a mapping")),
    Case("harness-component-not-text", ["harness.system=[1,2]"], ("'harness.system'",
                                                                  "a text")),
    Case("invalid-yaml", yaml="train: {steps: 3\n", expect=("not valid YAML",)),
    Case("manifest-is-a-list", yaml="- hf\n- arith\n", expect=("a list",)),
    Case("manifest-missing", argv=["run", "{tmp}/nope.yaml"], expect=("manifest not found",)),
    Case("override-without-equals", ["train.steps"], ("'train.steps'", "not key=value")),
    Case("override-list-missing-bracket", ["plugins=[hf,arith,grpo"],
         ("plugins=[hf,arith,grpo", "not valid", "[a,b]"), yaml=MINI),
    Case("out-is-a-file", ["out={tmp}/afile"], ("'out'", "is a file")),
    Case("model-unknown", ["model=no-such-model"], ("'model'", "'no-such-model'",
                                                    "nothing is downloaded")),
    # plugins
    Case("plugin-typo", ["plugins=[hf,arith,grpoo]"], ("'grpoo'", "Did you mean 'grpo'")),
    Case("plugin-twice", ["plugins=[hf,arith,grpo,grpo]"], ("more than once", "grpo")),
    Case("no-plugins", ["plugins=[]"], ("'plugins'", "no plugins")),
    Case("no-algorithm", ["plugins=[hf,arith]"], ("rlmix_advantage", "no owner"), yaml=MINI),
    Case("settings-for-unlisted-plugin", ["rloo.eps=0.1"], ("'rloo'", "not listed")),
    Case("two-envs", ["plugins=[hf,arith,math,grpo]"], ("'arith'", "'math'", "two envs"),
         yaml=MINI),
    Case("ray-without-engine", ["plugins=[ray,arith,grpo]"], ("'ray' needs a rollout engine",
                                                              "rlmix_generate", "hf"), yaml=MINI),
    # relations
    Case("group-size-1-grpo", ["train.group_size=1"], ("'train.group_size'", "'grpo'",
                                                       ">= 2")),
    Case("group-size-1-rloo", ["plugins=[hf,arith,grpo,rloo]", "train.group_size=1"],
         ("'train.group_size'", "'rloo'", ">= 2"), yaml=MINI),
    Case("group-size-1-reinforce-pp-group", ["plugins=[hf,arith,grpo,reinforce_pp]",
                                             "reinforce_pp.baseline=group",
                                             "train.group_size=1"],
         ("'train.group_size'", "'reinforce_pp'"), yaml=MINI),
    Case("in-backward-with-clipping", ["train.optimizer_in_backward=true"],
         ("'train.optimizer_in_backward'", "max_grad_norm")),
    Case("in-backward-with-accumulation", ["train.optimizer_in_backward=true",
                                           "train.max_grad_norm=0", "train.grad_accum=2"],
         ("'train.optimizer_in_backward'", "grad_accum")),
    # sizes
    Case("group-size-beyond-memory", ["train.group_size=100000000"],
         ("'train.group_size'", "GiB", "more than this machine")),
    Case("prompts-beyond-memory", ["train.prompts_per_step=100000000"],
         ("'train.prompts_per_step'", "GiB")),
    Case("max-new-tokens-beyond-context", ["sampling.max_new_tokens=4096"],
         ("'sampling.max_new_tokens'", "4096", "context", "512")),
    # score weights
    Case("weight-not-a-number", ["score.weights.arith.correct=high"],
         ("'score.weights.arith.correct'", "'high' is not a number")),
    Case("weight-infinite", ["score.weights.arith.correct=.inf"],
         ("'score.weights.arith.correct'", "finite")),
    Case("weight-unknown-term", ["score.weights.arith.correctness=1"],
         ("'score.weights.arith.correctness'", "no reward term 'correctness'",
          "correct, format")),
    Case("weight-unknown-plugin", ["score.weights.mathh.correct=1"],
         ("'score.weights.mathh.correct'", "'mathh' is not a listed plugin that scores",
          "arith")),
    Case("weight-for-a-plugin", ["score.weights.arith=2"],
         ("'score.weights.arith'", "per term")),
    # plugin settings (declared ranges and choices)
    Case("grpo-scale-unknown", ["grpo.scale=grop"], ("'grpo.scale'", "'grop'", "group")),
    Case("grpo-eps-low-1.5", ["grpo.eps_low=1.5"], ("'grpo.eps_low'", "plugin 'grpo'",
                                                    "1.5 is not allowed", "< 1")),
    Case("grpo-beta-negative", ["grpo.beta=-1"], ("'grpo.beta'", "-1")),
    Case("grpo-unknown-key", ["grpo.betta=1"], ("'grpo.betta'", "unknown key", "beta")),
    Case("grpo-kl-estimator-unknown", ["grpo.kl_estimator=k9"], ("'grpo.kl_estimator'",
                                                                  "'k9'")),
    Case("rloo-eps-negative", ["plugins=[hf,arith,rloo]", "rloo.eps=-1"], ("'rloo.eps'",),
         yaml=MINI),
    Case("ppo-critic-lr-0", ["plugins=[hf,arith,ppo]", "ppo.critic_lr=0"],
         ("'ppo.critic_lr'", "> 0"), yaml=MINI),
    Case("ppo-lam-2", ["plugins=[hf,arith,ppo]", "ppo.lam=2"], ("'ppo.lam'", "<= 1"), yaml=MINI),
    Case("kl-beta-negative", ["plugins=[hf,arith,grpo,kl]", "kl.beta=-0.1"], ("'kl.beta'",),
         yaml=MINI),
    Case("entropy-coef-negative", ["plugins=[hf,arith,grpo,entropy]", "entropy.coef=-1"],
         ("'entropy.coef'", "penalise entropy"), yaml=MINI),
    Case("gapo-min-fraction-0", ["plugins=[hf,arith,gapo]", "gapo.min_fraction=0"],
         ("'gapo.min_fraction'", "> 0"), yaml=MINI),
    Case("dapo-eps-high-below-low", ["plugins=[hf,arith,grpo,dapo.clip_higher]",
                                     "dapo.clip_higher.eps_high=0.1"],
         ("'dapo.clip_higher.eps_high'", "eps_low"), yaml=MINI),
    Case("reinforce-pp-gamma-2", ["plugins=[hf,arith,reinforce_pp]", "reinforce_pp.gamma=2"],
         ("'reinforce_pp.gamma'",), yaml=MINI),
    # the run folder and other commands
    Case("resume-nothing", argv=["run", "{manifest}", *BASE, "out={tmp}/fresh", "--resume"],
         expect=("--resume", "holds no run")),
    Case("resume-and-overwrite", argv=["run", "{manifest}", *BASE, "out={tmp}/x", "--resume",
                                       "--overwrite"], expect=("contradict",)),
    Case("eval-not-a-checkpoint", argv=["eval", "{manifest}", *TINY, "--checkpoint",
                                        "{tmp}/nothing"], expect=("not a checkpoint folder",)),
    Case("check-unknown-plugin", argv=["plugins", "--check", "grpoo"],
         expect=("no installed plugin named 'grpoo'", "did you mean 'grpo'")),
    Case("new-plugin-without-family", argv=["new-plugin", "thing", "--dir", "{tmp}"],
         expect=("--family is required",)),
    Case("config-schema-with-manifest", argv=["config", "{manifest}", "--schema"],
         expect=("take no manifest",)),
]


def test_the_table_is_large_and_its_ids_unique() -> None:
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_clear_line(case: Case, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    if case.skip:
        pytest.skip(case.skip)
    (tmp_path / "afile").write_text("not a folder\n")
    manifest = EXAMPLE
    if case.yaml is not None:
        manifest = tmp_path / "manifest.yaml"
        manifest.write_text(case.yaml)

    def fill(arg: str) -> str:
        return arg.replace("{tmp}", str(tmp_path)).replace("{manifest}", str(manifest))

    argv = ([fill(a) for a in case.argv] if case.argv is not None else
            ["run", str(manifest), *BASE, f"out={tmp_path / 'out'}",
             *[fill(o) for o in case.overrides]])
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert code == 2, f"accepted (exit {code}):\n{out[-1500:]}{err[-1500:]}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rlmix: error: "), err
    for words in case.expect:
        assert words in lines[0], f"{words!r} not in: {lines[0]}"
