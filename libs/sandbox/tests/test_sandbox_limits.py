"""rlmix_sandbox, each limit measured with a hostile program: the whole run's memory and disk, the
file system view (no host file, package or socket), a timeout the program cannot dodge, and a
spawn path that is safe with threads."""

from __future__ import annotations

import ast
import os
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import rlmix_sandbox as sandbox
from rlmix_sandbox import capabilities, leftover_pids, run_many, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux sandbox")
CAPS = capabilities()
FULL = pytest.mark.skipif(CAPS["mode"] != "full",
                          reason=f"full containment unavailable: {CAPS['missing']}")


def _clean(r: sandbox.SandboxResult) -> None:
    assert leftover_pids(r.uid, r.pgid) == []


def test_the_spawn_path_runs_no_python_between_fork_and_exec() -> None:
    for path in (sandbox.__file__, sandbox._LAUNCHER):
        tree = ast.parse(Path(path).read_text())
        kwargs = [k.arg for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords]
        assert "preexec_fn" not in kwargs, path


def test_runs_from_many_threads_while_others_hold_locks() -> None:
    # a thread holding a lock across the spawns: a preexec_fn child could deadlock on it
    lock = threading.Lock()
    stop = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            with lock:
                time.sleep(0.001)

    t = threading.Thread(target=hog, daemon=True)
    t.start()
    try:
        results = run_many([f"print({i})" for i in range(8)], workers=4, timeout_s=20)
    finally:
        stop.set()
        t.join()
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]


@FULL
def test_memory_cap_holds_for_the_whole_process_group() -> None:
    # 6 children x 200 MB, each under the per-process address-space limit, 1.2 GB together
    code = textwrap.dedent("""
        import os, time
        kids = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                x = bytearray(200 * 1024 * 1024)
                for i in range(0, len(x), 4096):
                    x[i] = 1
                time.sleep(3)
                os._exit(0)
            kids.append(pid)
        print(sum(os.waitpid(pid, 0)[1] == 0 for pid in kids))
    """)
    r = run_python(code, memory_mb=512, timeout_s=30, max_procs=16)
    # at most two 200 MB children fit in 512 MB; the rest were killed by the group's cap
    assert r.status in ("ok", "oom"), r
    if r.status == "ok":
        assert int(r.stdout) <= 2, r.stdout
    _clean(r)


@FULL
def test_disk_cap_holds_for_the_run_folder() -> None:
    # 30 files x 16 MB: each under max_file_mb, 480 MB together, on a 64 MB run folder
    code = textwrap.dedent("""
        import errno
        written = 0
        try:
            for i in range(30):
                with open(f"f{i}", "wb") as f:
                    f.write(b"x" * (16 * 1024 * 1024 - 1))
                written += 1
        except OSError as e:
            print("stopped at", written, errno.errorcode[e.errno])
    """)
    r = run_python(code, disk_mb=64, max_file_mb=16, memory_mb=1024, timeout_s=30)
    assert r.status == "ok", r
    stopped, errname = r.stdout.split()[2:4]
    assert int(stopped) <= 4 and errname == "ENOSPC", r.stdout
    _clean(r)


@FULL
def test_the_view_holds_only_the_interpreter_and_the_run_folder() -> None:
    code = textwrap.dedent("""
        import os, sys, glob
        print(sorted(os.listdir("/")))
        print(os.getcwd(), os.environ["HOME"])
        sp = [p for p in glob.glob(sys.prefix + "/lib/python3*/site-packages")]
        print(sp and os.listdir(sp[0]))
        for path in ["/proc/self/environ", "/etc/passwd", "/root/.bashrc", "/tmp", "/home",
                     "/work/wt", "/usr/bin/env", "/run"]:
            print(path, os.path.exists(path))
        try:
            import pytest
            print("IMPORTED pytest")
        except ImportError:
            print("no pytest")
        print(len(glob.glob("/**/HumanEval.jsonl.gz", recursive=True)))
    """)
    r = run_python(code)
    assert r.status == "ok", r
    lines = r.stdout.splitlines()
    top = ast.literal_eval(lines[0])
    assert set(top) <= {"work", "dev", "lib", "lib64", "usr", "etc", "root", "opt", "bin"}, top
    assert lines[1] == f"{sandbox.RUN_DIR} {sandbox.RUN_DIR}"
    assert lines[2] == "[]"  # site-packages masked by an empty mount
    assert all(line.endswith("False") for line in lines[3:11]), lines[3:11]
    assert lines[11] == "no pytest" and lines[12] == "0"


@FULL
def test_host_unix_sockets_are_unreachable(tmp_path: Path) -> None:
    path = str(tmp_path / "host.sock")
    abstract = f"\0rlmix-test-{os.getpid()}"
    servers = []
    for address in (path, abstract):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        s.listen(1)
        servers.append(s)
    try:
        code = textwrap.dedent(f"""
            import socket
            for address in ({path!r}, {abstract!r}):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(address)
                    print("CONNECTED")
                except OSError as e:
                    print("refused", type(e).__name__)
        """)
        r = run_python(code)
    finally:
        for s in servers:
            s.close()
    assert r.status == "ok" and "CONNECTED" not in r.stdout, r
    assert r.stdout.count("refused") == 2


def test_timeout_cannot_be_dodged() -> None:
    # ignores every catchable signal, blocks SIGALRM, leaves its group with setsid children and
    # keeps a non-daemon thread busy: the wall-clock limit still ends everything
    code = textwrap.dedent("""
        import os, signal, threading, time
        for s in range(1, 32):
            try:
                signal.signal(s, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
        for _ in range(3):
            if os.fork() == 0:
                os.setsid()
                while True:
                    time.sleep(1)
        threading.Thread(target=lambda: [time.sleep(1) for _ in iter(int, 1)]).start()
        while True:
            pass
    """)
    started = time.monotonic()
    r = run_python(code, timeout_s=1.5, cpu_s=60)
    assert r.status == "timeout" and time.monotonic() - started < 10, r
    _clean(r)


def test_threads_count_against_max_procs() -> None:
    # RLIMIT_NPROC counts processes AND threads of the run's uid (the kernel's task count)
    code = textwrap.dedent("""
        import threading, time
        n = 0
        try:
            for _ in range(200):
                threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
                n += 1
        except RuntimeError:
            pass
        print(n)
    """)
    r = run_python(code, max_procs=12, timeout_s=20)
    assert r.status == "ok", r
    assert int(r.stdout) < 12


def test_weak_mode_is_loud_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_caps", {**CAPS, "mode": "weak", "namespaces": False,
                                           "missing": ["(test) namespaces"],
                                           "python": CAPS["weak_python"] or CAPS["python"]})
    monkeypatch.setattr(sandbox, "_warned", False)
    refused = run_python("print(1)", require_full=True)
    assert refused.status == "sandbox_error" and "full containment" in refused.reason
    with pytest.warns(RuntimeWarning, match="WEAKLY"):
        r = run_python("print(1)")
    assert r.status == "ok" and "weak" in r.isolation


@pytest.mark.slow  # a child trainer starts, probes the machine and is killed: ~20 s under load
@FULL
def test_a_run_dies_with_its_trainer() -> None:
    """No parent enforces the timeout once the trainer is gone: the launcher's reapers carry
    PR_SET_PDEATHSIG, so the run (PID namespace and all) ends with the trainer."""
    import subprocess
    trainer = textwrap.dedent("""
        import os, threading, time
        import rlmix_sandbox as sandbox
        print(sandbox._uid_base(), flush=True)
        threading.Thread(target=sandbox.run_python, daemon=True,
                         args=("import time\\nwhile True: time.sleep(1)",),
                         kwargs={"timeout_s": 300}).start()
        time.sleep(3)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", trainer], capture_output=True, text=True,
                         timeout=120)
    base = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [u for u in range(base, base + 256) if leftover_pids(u)]
        if not left:
            break
        time.sleep(0.2)
    assert left == []
