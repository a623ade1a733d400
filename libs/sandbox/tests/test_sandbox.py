"""rlmix_sandbox: hostile programs are contained, get the expected status, leave nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import rlmix_sandbox as sandbox
from rlmix_sandbox import capabilities, leftover_pids, run_many, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux sandbox")

CAPS = capabilities()
ROOT_ONLY = pytest.mark.skipif(not CAPS["drop_uid"], reason="needs root to drop to its own uid")


def assert_clean(result: sandbox.SandboxResult) -> None:
    """No process of the run's group or uid is alive, and its work folder is gone."""
    assert result.pgid is not None
    assert leftover_pids(result.uid, result.pgid) == []


def test_normal_program_and_stdin() -> None:
    code = "import sys\nname = input()\nprint('hello', name)\nprint('err', file=sys.stderr)"
    r = run_python(code, stdin="world\n")
    assert (r.status, r.returncode) == ("ok", 0), r
    assert r.stdout == "hello world\n"
    assert r.stderr == "err\n"
    assert_clean(r)


def test_error_and_output_cap() -> None:
    r = run_python("print('x' * 5000)\nassert 1 == 2, 'nope'", max_output_bytes=100)
    assert r.status == "error" and r.returncode == 1
    assert "AssertionError: nope" in r.reason
    assert r.stdout.startswith("x" * 100) and r.stdout.endswith("[truncated]")
    assert r.stderr.endswith("AssertionError: nope\n") and len(r.stderr) < 200
    assert len(r.stdout) < 200


def test_network_is_blocked() -> None:
    code = textwrap.dedent("""
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect(("1.1.1.1", 53))
        print("connected")
    """)
    r = run_python(code, timeout_s=5)
    assert r.status == "error", r
    assert "connected" not in r.stdout
    assert "netns" in r.isolation or "socket-shim" in r.isolation
    assert_clean(r)


def test_socket_shim_without_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_caps", {**CAPS, "namespaces": False, "mode": "weak",
                                           "python": CAPS["weak_python"]})
    r = run_python("import socket\nsocket.create_connection(('127.0.0.1', 1))\nprint('up')")
    assert r.status == "error" and "disabled in the rlmix sandbox" in r.stderr, r
    assert "socket-shim" in r.isolation


@ROOT_ONLY
def test_fork_bomb_is_contained() -> None:
    code = textwrap.dedent("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    r = run_python(code, timeout_s=1.5, max_procs=16)
    assert r.status == "timeout", r
    assert r.uid is not None
    assert_clean(r)


def test_fork_limit_raises_in_the_program() -> None:
    code = textwrap.dedent("""
        import os, time
        kids = 0
        try:
            for _ in range(100):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                kids += 1
        except OSError as e:
            print("limited at", kids, e.errno)
    """)
    r = run_python(code, timeout_s=10, max_procs=8)
    assert r.status == "ok", r
    assert r.stdout.startswith("limited at"), r.stdout
    assert int(r.stdout.split()[2]) < 8
    assert_clean(r)  # the sleeping children were killed when the parent exited


def test_memory_blowup_is_oom() -> None:
    r = run_python("x = bytearray(4 * 1024 ** 3)\nprint('allocated')", memory_mb=256)
    assert r.status == "oom", r
    assert "allocated" not in r.stdout
    assert_clean(r)


def test_infinite_loop_times_out() -> None:
    r = run_python("while True:\n    pass", timeout_s=1.0, cpu_s=30)
    assert r.status == "timeout" and "wall-clock" in r.reason, r
    assert r.duration_s < 5
    assert_clean(r)


def test_cpu_limit() -> None:
    r = run_python("while True:\n    pass", timeout_s=20, cpu_s=1)
    assert r.status == "timeout" and "CPU" in r.reason, r
    assert_clean(r)


@ROOT_ONLY
def test_writing_outside_the_work_folder_fails(tmp_path: os.PathLike[str]) -> None:
    target = os.path.join(str(tmp_path), "escaped.txt")
    code = textwrap.dedent(f"""
        import os
        open("inside.txt", "w").write("ok")
        print(os.path.exists("inside.txt"))
        for path in [{target!r}, "/tmp/rlmix-escaped.txt", "../escaped.txt", "/etc/escaped"]:
            try:
                open(path, "w").write("x")
                print("WROTE", path)
            except OSError as e:
                print("denied", path, e.errno)
    """)
    r = run_python(code)
    assert r.status == "ok", r
    assert "WROTE" not in r.stdout and r.stdout.startswith("True"), r.stdout
    assert r.stdout.count("denied") == 4
    assert not os.path.exists(target) and not os.path.exists("/etc/escaped")


def test_environment_secrets_are_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLMIX_TEST_SECRET", "hunter2")
    code = textwrap.dedent("""
        import os
        print(sorted(os.environ))
        print("SECRET" if "hunter2" in str(os.environ) else "clean")
        try:
            print(open(f"/proc/{os.getppid()}/environ").read())
        except OSError as e:
            print("denied", e.errno)
    """)
    r = run_python(code)
    assert r.status == "ok", r
    assert "hunter2" not in r.stdout and "RLMIX_TEST_SECRET" not in r.stdout
    if CAPS["drop_uid"]:
        assert "denied" in r.stdout


def test_killing_the_parent_does_not_kill_the_trainer() -> None:
    # the "trainer" is a child interpreter, so a failure here cannot take pytest down with it
    trainer = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("sbx", {sandbox.__file__!r})
        sbx = importlib.util.module_from_spec(spec)
        sys.modules["sbx"] = sbx
        spec.loader.exec_module(sbx)
        run_python = sbx.run_python
        r = run_python("import os, signal\\nos.kill(os.getppid(), signal.SIGKILL)\\n"
                       "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)")
        print("trainer alive", r.status)
    """)
    out = subprocess.run([sys.executable, "-c", trainer], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("trainer alive"), out.stdout


def test_run_many_keeps_order_and_cleans_up() -> None:
    jobs = ["import os\nprint(os.getcwd())",
            "while True: pass",
            {"code": "print(input())", "stdin": "echo"},
            "x = bytearray(1 << 33)",
            "raise SystemExit(3)",
            "print(1 + 1)"]
    results = run_many(jobs, workers=3, timeout_s=1.5)
    assert [r.status for r in results] == ["ok", "timeout", "ok", "oom", "error", "ok"]
    assert results[2].stdout == "echo\n" and results[5].stdout == "2\n"
    workdir = results[0].stdout.strip()
    if CAPS["mode"] == "full":
        assert workdir == sandbox.RUN_DIR  # its own view: the host's folder is never shown
    else:
        assert workdir and not os.path.exists(workdir)
    if CAPS["drop_uid"]:
        assert len({r.uid for r in results}) > 1  # concurrent runs get their own uids
    for r in results:
        assert_clean(r)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="code"):
        run_many([{"stdin": "x"}])
    with pytest.raises(ValueError, match="outside"):
        run_python("pass", files={"../x.py": ""})
