"""Kills ``rlmix run`` with SIGKILL at chosen moments and checks that no step is lost or
duplicated (driven by tests/test_crash_windows.py; not a test module itself).

One driver process imports torch, transformers and the plugins once, then forks a child per
attempt: the child runs ``rlmix.cli.main`` on tiny-random and SIGKILLs itself at the moment
under test (a patched function fires the signal), so each kill lands exactly in its window.
After each kill the next child resumes (``--resume`` when the folder holds a run, as a user or
a supervisor would); after the kills one child finishes the run. Windows:

* ``after_metrics``: a step's metrics line is written (and fsynced), its checkpoint is not.
* ``during_checkpoint``: inside a checkpoint write (even kills: before its rng.pt, in the
  temporary folder) or inside the deletion of an old checkpoint (odd kills: half removed).
* ``after_checkpoint``: a step's checkpoint is visible (the window that lost lines when the
  checkpointer ran before the logger).
* ``startup``: while a run starts: after validation and the lock, after the model loads, after
  plugins configure, after the manifest is written, after the start evaluation's line, after a
  resume restored its checkpoint (four kills of a fresh run, six of a run resumed at step 4).

Usage: ``python tests/crash_driver.py OUT_ROOT [WINDOW ...]``; prints one JSON object.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

STEPS = 13
KILLS = 10
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo-arith.yaml"
ARGS = ["model=tiny-random", "arith.eval_size=4", "arith.eval_max_new_tokens=4",
        "sampling.max_new_tokens=4", "train.prompts_per_step=2", "train.group_size=2",
        f"train.steps={STEPS}", "train.checkpoint_every=1", "train.keep_checkpoints=2",
        "train.eval_every=0", "log.progress=false", "log.plot=false"]
STARTUP_STAGES = ("prepared", "policy_loaded", "configured", "manifest_written", "start_eval",
                  "restored")
WINDOWS = ("after_metrics", "during_checkpoint", "after_checkpoint", "startup")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(window: str, target: int, variant: int) -> None:
    """In the child: patch the moment of ``window`` at step ``target`` to SIGKILL."""
    import shutil

    import torch

    from rlmix import checkpoint, loop, observe

    if window == "after_metrics" or (window == "startup" and STARTUP_STAGES[variant] ==
                                     "start_eval"):
        write = observe.ObservePlugin.write

        def write_then_die(self: Any, run: Any, metrics: dict[str, Any]) -> None:
            write(self, run, metrics)
            training = "loss" in metrics
            if (window == "startup" and not training) or (training and
                                                          metrics["step"] == target):
                die()
        observe.ObservePlugin.write = write_then_die  # type: ignore[method-assign]
    elif window == "during_checkpoint" and variant % 2 == 0:
        save = torch.save

        def save_or_die(obj: Any, f: Any, *a: Any, **k: Any) -> Any:
            path = str(f)
            if path.endswith("rng.pt") and f".tmp-step-{target:06d}-" in path:
                die()
            return save(obj, f, *a, **k)
        torch.save = save_or_die  # type: ignore[assignment]
    elif window == "during_checkpoint":
        rmtree = shutil.rmtree

        def rmtree_half(path: Any, *a: Any, **k: Any) -> Any:
            p = Path(path)
            if p.name.startswith(".del-") and loop_step[0] == target:
                files = sorted(f for f in p.rglob("*") if f.is_file())
                for f in files[: len(files) // 2]:
                    f.unlink()
                die()
            return rmtree(path, *a, **k)
        loop_step = [0]
        save_ = checkpoint.save

        def track(run: Any, keep: int = 2) -> Path:
            loop_step[0] = run.step
            return save_(run, keep)
        checkpoint.save = track  # type: ignore[assignment]
        checkpoint.shutil.rmtree = rmtree_half  # type: ignore[attr-defined]
    elif window == "after_checkpoint":
        save = checkpoint.save

        def save_then_die(run: Any, keep: int = 2) -> Path:
            folder = save(run, keep)
            if run.step == target:
                die()
            return folder
        checkpoint.save = save_then_die  # type: ignore[assignment]
    elif window == "startup":
        stage = STARTUP_STAGES[variant]
        if stage == "prepared":
            build = loop.load_policy

            def die_first(run: Any) -> None:
                die()
            loop.load_policy = die_first  # type: ignore[assignment]
            del build
        elif stage == "policy_loaded":
            load = loop.load_policy

            def load_then_die(run: Any) -> None:
                load(run)
                die()
            loop.load_policy = load_then_die  # type: ignore[assignment]
        elif stage == "configured":
            configure = loop.configure

            def configure_then_die(run: Any) -> None:
                configure(run)
                die()
            loop.configure = configure_then_die  # type: ignore[assignment]
        elif stage == "manifest_written":
            from rlmix import runfolder

            written = loop._write_whole

            def write_then_die_(path: Path, text: str) -> None:
                written(path, text)
                if path.name == runfolder.MANIFEST_FILE:
                    die()
            loop._write_whole = write_then_die_  # type: ignore[assignment]
        elif stage == "restored":
            restore = checkpoint.restore

            def restore_then_die(run: Any, folder: Path) -> None:
                restore(run, folder)
                die()
            checkpoint.restore = restore_then_die  # type: ignore[assignment]


def child(out: Path, window: str | None, target: int, variant: int, log: Path) -> int:
    """Fork a child running ``rlmix run`` (armed to die in ``window``); its exit status."""
    from rlmix import cli, runfolder

    resume = runfolder.describe_run(out) is not None
    pid = os.fork()
    if pid == 0:  # the child
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            if window is not None:
                arm(window, target, variant)
            code = cli.main(["run", str(EXAMPLE), *ARGS, f"out={out}",
                             *(["--resume"] if resume else [])])
        except BaseException:  # noqa: BLE001 - reported through the exit status
            import traceback

            traceback.print_exc()
            code = 99
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def verify(out: Path) -> dict[str, Any]:
    from rlmix import checkpoint, observe

    rows = observe.read_metrics(out / observe.METRICS_FILE)
    steps = [int(r["step"]) for r in rows]
    wanted = list(range(STEPS + 1))  # 0: the start evaluation; then every step once
    lost = sorted(set(wanted) - set(steps))
    duplicated = sorted({s for s in steps if steps.count(s) > 1})
    root = out / "checkpoints"
    leftovers = sorted(p.name for p in root.iterdir() if not p.name.startswith("step-")) \
        if root.exists() else []
    last = checkpoint.latest(root)
    versions_ok = [r.get("policy_version") for r in rows[1:]] == list(range(1, STEPS + 1))
    return {"steps": steps, "lost": lost, "duplicated": duplicated, "leftovers": leftovers,
            "latest": last.name if last else None, "versions_ok": versions_ok}


def window_run(root: Path, window: str) -> dict[str, Any]:
    out = root / window
    log = root / f"{window}.log"
    codes = []
    started = time.perf_counter()
    if window == "startup":
        stage = STARTUP_STAGES.index
        # a fresh run, four times: the later ones resume a run that has no checkpoint yet
        for name in ("prepared", "policy_loaded", "manifest_written", "start_eval"):
            codes.append(child(out, "startup", 0, stage(name), log))
        # a run that gets to step 4 (not counted), then the start-ups of resumed runs
        prep = child(out, "after_metrics", 4, 0, log)
        for name in ("prepared", "policy_loaded", "configured", "restored",
                     "manifest_written", "restored"):
            codes.append(child(out, "startup", 0, stage(name), log))
    else:
        prep = None
        for i in range(KILLS):
            codes.append(child(out, window, i + 2, i, log))
    final = child(out, None, 0, 0, log)
    report = verify(out)
    report.update({"window": window, "kills": sum(c == -signal.SIGKILL for c in codes),
                   "attempts": len(codes), "codes": codes, "final": final, "prep": prep,
                   "seconds": round(time.perf_counter() - started, 1)})
    return report


def main() -> None:
    root = Path(sys.argv[1])
    windows = sys.argv[2:] or list(WINDOWS)
    root.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    # import everything the children need once, before any fork (no threads started yet)
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    from rlmix import checkpoint, cli, loop, observe, plugins, runfolder  # noqa: F401

    for name in ("rlmix_hf", "rlmix_arith", "rlmix_grpo", "rlmix_fused_logprobs"):
        __import__(name)
    plugins.installed()
    # the first save_pretrained imports half of transformers' serialisation: once, here
    from rlmix.policy import tiny_random

    model, tokenizer = tiny_random()
    model.save_pretrained(root / ".warm")
    tokenizer.save_pretrained(root / ".warm")
    del model, tokenizer
    print(json.dumps([window_run(root, w) for w in windows]))


if __name__ == "__main__":
    main()
