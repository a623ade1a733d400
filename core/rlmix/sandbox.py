"""Run untrusted (model-written) Python in a contained child process.

``run_python(code)`` runs one program and returns a :class:`SandboxResult`; ``run_many(jobs)``
runs many in parallel (a thread pool of subprocess launches) and returns their results in order.

What contains a program (each layer is used where the machine allows it; ``result.isolation``
names the layers that held for that run):

- its own session and process group (``start_new_session``); on exit or timeout the whole group
  is killed with SIGKILL, and when the program ran under its own uid every process of that uid is
  killed too (a program that calls ``setsid`` to leave its group is still found);
- resource limits set before ``exec``: ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address
  space), ``RLIMIT_NPROC`` (processes and threads), ``RLIMIT_FSIZE`` (largest file written),
  ``RLIMIT_CORE = 0``;
- when the trainer runs as root: a fresh, otherwise unused uid/gid per concurrent run (so
  ``RLIMIT_NPROC``, which root ignores, holds; signals to the trainer fail with EPERM; other
  processes' ``/proc/<pid>/environ`` is unreadable), a fresh network namespace (no interface but a
  down loopback) and a mount namespace in which every file system is read-only except the run's
  temporary folder;
- without root: sockets are blocked by a prelude that replaces ``socket.socket`` (best effort, a
  determined program can get around it) and the limits above apply to the trainer's own user;
- a fresh temporary working folder (also ``HOME`` and ``TMPDIR``), removed afterwards;
- a minimal environment (``PATH=/usr/bin:/bin``, ``LANG``, ``PYTHONDONTWRITEBYTECODE``,
  ``PYTHONIOENCODING``; nothing inherited) and ``python -I -S`` (no user site, no site-packages,
  no ``PYTHON*`` variables): the standard library is all a program can import.

The program's stdout and stderr go to files (so a chatty program cannot fill the trainer's
memory), are capped at ``max_file_mb`` by ``RLIMIT_FSIZE`` and are returned truncated to
``max_output_bytes`` (stdout keeps its head, stderr its tail, where a traceback ends).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STATUSES", "SandboxResult", "capabilities", "leftover_pids", "run_many",
           "run_python"]

#: every value ``SandboxResult.status`` takes
STATUSES = ("ok", "error", "timeout", "oom", "killed", "sandbox_error")

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_KEEP_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC}

_TRUNCATED = "\n...[truncated]"


@dataclass
class SandboxResult:
    """What one sandboxed run did.

    ``status``: ``ok`` (exit code 0), ``error`` (non-zero exit: an exception, a failed assert,
    ``sys.exit(1)``), ``timeout`` (wall-clock or CPU-time limit), ``oom`` (the address-space limit
    was hit: ``MemoryError``), ``killed`` (ended by another signal, e.g. SIGXFSZ for the file-size
    limit), ``sandbox_error`` (the sandbox itself could not start the program).
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

_libc: Any = None
_caps: dict[str, Any] | None = None
_caps_lock = threading.Lock()


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.unshare.argtypes = [ctypes.c_int]
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                ctypes.c_ulong, ctypes.c_void_p]
    return _libc


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


def _find_python(dropping_uid: bool) -> str | None:
    candidates = [sys.executable]
    if dropping_uid:
        candidates += ["/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"]
    for exe in candidates:
        if exe and os.path.exists(exe) and (not dropping_uid or _usable_by_others(exe)):
            return exe
    return None


def _writable_mounts() -> list[tuple[str, int]]:
    """Mount points a dropped uid could write to, with the flags to keep on a read-only remount."""
    out: list[tuple[str, int]] = []
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) < 6:
            continue
        target = parts[4].encode().decode("unicode_escape")
        opts = parts[5].split(",")
        if "ro" in opts:
            continue
        if target.startswith(("/proc", "/sys")) or (
                target.startswith("/dev") and not target.startswith(("/dev/shm", "/dev/mqueue"))):
            continue
        keep = 0
        for opt in opts:
            keep |= _KEEP_FLAGS.get(opt, 0)
        if (target, keep) not in out:
            out.append((target, keep))
    return out


def _probe_namespaces() -> bool:
    """Can a child enter fresh network and mount namespaces? Tried once, on /bin/true."""
    try:
        libc = _load_libc()
    except OSError:
        return False

    def pre() -> None:
        if libc.unshare(_CLONE_NEWNET | _CLONE_NEWNS) != 0:
            os._exit(3)
        if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
            os._exit(4)

    true = shutil.which("true") or "/bin/true"
    try:
        return subprocess.run([true], preexec_fn=pre, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def capabilities() -> dict[str, Any]:
    """What this machine lets the sandbox do: ``root`` (uid drop), ``namespaces`` (network and
    mount namespaces), ``python`` (the interpreter sandboxed programs run under)."""
    global _caps
    with _caps_lock:
        if _caps is None:
            root = os.geteuid() == 0
            ns = root and sys.platform.startswith("linux") and _probe_namespaces()
            python = _find_python(root)
            drop = root and python is not None
            if root and python is None:  # no interpreter an unprivileged uid can run
                python = _find_python(False)
            _caps = {"root": root, "drop_uid": drop, "namespaces": ns, "python": python,
                     "mounts": _writable_mounts() if ns else []}
        return _caps


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
# the child side

_PRELUDE = r"""
import sys
if {block_sockets}:
    import _socket, socket
    def _no_network(*a, **k):
        raise PermissionError(1, "network access is disabled in the rlmix sandbox")
    class _BlockedSocket(socket.socket):
        def __init__(self, *a, **k):
            _no_network()
    socket.socket = _BlockedSocket
    _socket.socket = _BlockedSocket
    socket.create_connection = socket.socketpair = socket.fromfd = _no_network
    socket.getaddrinfo = socket.gethostbyname = _no_network
    del _BlockedSocket, _no_network, socket, _socket
sys.argv = ["main.py"] + {argv!r}
sys.path.insert(0, {workdir!r})
with open("main.py", "rb") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f
_g = {{"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}}
exec(_code, _g)
"""


def _preexec(*, workdir: str, uid: int | None, namespaces: bool, mounts: list[tuple[str, int]],
             limits: list[tuple[int, int, int]], libc: Any) -> Any:
    """The function run in the child between fork and exec (as the trainer's user)."""
    wd = workdir.encode()

    def pre() -> None:
        if namespaces:
            if libc.unshare(_CLONE_NEWNET | _CLONE_NEWNS) != 0:
                os._exit(120)
            if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
                os._exit(121)
            # the work folder becomes its own mount first, so the read-only remounts below
            # leave it writable
            if libc.mount(wd, wd, None, _MS_BIND, None) != 0:
                os._exit(122)
            for target, keep in mounts:
                t = target.encode()
                # remount read-only; where that fails, bind it onto itself and try again
                # (failures on odd mounts are ignored: the uid drop still holds there)
                if libc.mount(None, t, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | keep, None):
                    if libc.mount(t, t, None, _MS_BIND | _MS_REC, None) == 0:
                        libc.mount(None, t, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | keep,
                                   None)
            if libc.mount(None, wd, None, _MS_REMOUNT | _MS_BIND, None) != 0:  # rw again
                os._exit(123)
            os.chdir(workdir)  # through the new mount, not the read-only one below
        for res, soft, hard in limits:
            resource.setrlimit(res, (soft, hard))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        os.umask(0o077)

    return pre


# ------------------------------------------------------------------------------------------------
# the public API


def run_python(code: str, *, stdin: str = "", timeout_s: float = 5.0, cpu_s: float | None = None,
               memory_mb: int = 512, max_procs: int = 64, max_file_mb: int = 16,
               network: bool = False, env: dict[str, str] | None = None,
               files: Mapping[str, str] | None = None, argv: list[str] | None = None,
               max_output_bytes: int = 65536) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh temporary folder under the limits in the module doc.

    ``timeout_s``: wall-clock limit (the whole process group is killed); ``cpu_s``: CPU-seconds
    limit (default: ``timeout_s`` rounded up); ``memory_mb``: address-space limit;
    ``max_procs``: processes + threads of the run's uid (or of the trainer's user without root);
    ``max_file_mb``: largest file (and stdout/stderr) it may write; ``network``: keep the host's
    network (default off); ``env``: extra environment variables (nothing else is inherited);
    ``files``: extra files written next to ``main.py`` (relative paths); ``argv``: ``sys.argv[1:]``;
    ``max_output_bytes``: stdout and stderr are truncated to this many bytes each.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb < 32:
        raise ValueError(f"memory_mb must be >= 32, got {memory_mb}")
    if max_procs < 1 or max_file_mb < 1 or max_output_bytes < 0:
        raise ValueError("max_procs and max_file_mb must be >= 1, max_output_bytes >= 0")
    caps = capabilities()
    python = caps["python"]
    if python is None:
        return SandboxResult("sandbox_error", None, "", "", 0.0, "no Python interpreter found")
    drop = caps["drop_uid"]
    use_ns = caps["namespaces"] and not network
    isolation = ["pgroup", "rlimits", "tmpdir", "minimal-env"]
    uid = _take_uid() if drop else None
    if uid is not None:
        isolation.append(f"uid={uid}")
    if use_ns:
        isolation += ["netns", "readonly-fs"]
    elif not network:
        isolation.append("socket-shim")

    cpu = int(cpu_s if cpu_s is not None else timeout_s + 0.999)
    cpu = max(cpu, 1)
    fsize = max_file_mb * 1024 * 1024
    nproc = max_procs
    if uid is None and os.geteuid() != 0:
        # RLIMIT_NPROC counts every process of the user: allow what runs already, plus max_procs
        nproc = len(_pids_of_uid(os.geteuid())) + max_procs
    limits = [(resource.RLIMIT_CPU, cpu, cpu + 1),
              (resource.RLIMIT_AS, memory_mb * 1024 * 1024, memory_mb * 1024 * 1024),
              (resource.RLIMIT_NPROC, nproc, nproc),
              (resource.RLIMIT_FSIZE, fsize, fsize),
              (resource.RLIMIT_CORE, 0, 0)]

    outer = tempfile.mkdtemp(prefix="rlmix-sbx-")
    os.chmod(outer, 0o711)  # the run's uid may pass through to ``work``, not list or read
    workdir = os.path.join(outer, "work")
    os.mkdir(workdir, 0o700)
    started = time.monotonic()
    proc: subprocess.Popen[bytes] | None = None
    timed_out = False
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        for rel, text in (files or {}).items():
            path = os.path.normpath(os.path.join(workdir, rel))
            if not path.startswith(workdir + os.sep):
                raise ValueError(f"files: {rel!r} is outside the work folder")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        if uid is not None:
            for root, dirs, names in os.walk(workdir):
                for name in [root] + [os.path.join(root, n) for n in dirs + names]:
                    os.chown(name, uid, uid)
        child_env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
                     "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                     "PYTHONIOENCODING": "utf-8"}
        child_env.update(env or {})
        prelude = _PRELUDE.format(block_sockets=not network and not use_ns,
                                  argv=list(argv or []), workdir=workdir)
        pre = _preexec(workdir=workdir, uid=uid, namespaces=use_ns, mounts=caps["mounts"],
                       limits=limits, libc=_load_libc() if use_ns else None)
        # the files live in ``outer`` (the trainer's, mode 0700): the child only holds their fds
        with _private(outer, "stdin") as fin, _private(outer, "stdout") as fout, \
                _private(outer, "stderr") as ferr:
            fin.write(stdin.encode("utf-8"))
            fin.seek(0)
            try:
                proc = subprocess.Popen([python, "-I", "-S", "-c", prelude], stdin=fin,
                                        stdout=fout, stderr=ferr, cwd=workdir, env=child_env,
                                        start_new_session=True, preexec_fn=pre, close_fds=True)
            except (OSError, subprocess.SubprocessError) as e:
                return SandboxResult("sandbox_error", None, "", "", time.monotonic() - started,
                                     f"could not start the program: {e}", tuple(isolation))
            try:
                returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _sweep(proc.pid, uid)
                returncode = proc.wait()
            duration = time.monotonic() - started
            _sweep(proc.pid, uid)  # whatever it left behind (daemons, setsid escapees)
            stdout = _read_capped(fout, max_output_bytes)
            stderr = _read_capped(ferr, max_output_bytes, tail=True)
    finally:
        if proc is not None and proc.returncode is None:
            _sweep(proc.pid, uid)
            proc.wait()
        shutil.rmtree(outer, ignore_errors=True)
        if uid is not None:
            _give_uid(uid)
    status, reason = _classify(returncode, stderr, timed_out, timeout_s, cpu, memory_mb,
                               max_file_mb)
    return SandboxResult(status, returncode, stdout, stderr, duration, reason, tuple(isolation),
                         pgid=proc.pid if proc is not None else None, uid=uid)


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
