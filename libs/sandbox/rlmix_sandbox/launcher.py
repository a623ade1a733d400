"""The first code a sandboxed run executes: it builds the run's containment, then runs the
program in the same (fresh, single-threaded) interpreter.

:mod:`rlmix_sandbox` starts ``python -I -S -c <this file's text> <config path>`` with
``subprocess.Popen`` and ``start_new_session=True`` only (no ``preexec_fn``, which Python documents
as unsafe in a process with threads: the trainer scores from a thread pool). Everything that used
to happen between ``fork`` and ``exec`` happens here instead, in a process that has one thread and
nothing of the trainer's state. It runs as the trainer's user (root where containment is full)
until the last step, which drops to the run's own uid.

Full containment (``mode == "full"``), in order:

1. join the run's cgroups (memory and pids), made and limited by the parent, so that every process
   the program ever starts is counted against one memory cap and one process cap;
2. ``unshare`` fresh mount, network, PID, IPC and UTS namespaces and ``fork``: the child is PID 1
   of the new PID namespace (when it ends the kernel kills every process left in it, wherever
   they moved their session or group), this process stays outside as its reaper and hands the
   program's exit status on; PID 1 builds the view and forks the program (PID 2), so that the
   program keeps ordinary signal semantics (SIGXCPU, SIGXFSZ end it; init would ignore them);
3. in the child: a new root on a small tmpfs holding only read-only bind mounts of the interpreter,
   its standard library (with ``site-packages`` masked by an empty mount), the shared libraries
   they load and ``/dev/{null,zero,random,urandom}``; the run folder ``/work`` on its own tmpfs of
   fixed size; ``pivot_root`` into it and the host's tree detached. No ``/proc``, no ``/tmp`` of
   the host, no home, no project, no Unix socket file of the host is reachable;
4. resource limits, ``PR_SET_NO_NEW_PRIVS``, no supplementary groups, the run's own gid and uid,
   ``umask 077``, a minimal environment, then ``main.py`` runs as ``__main__``.

Weak containment (``mode == "weak"``: no root or no namespaces): resource limits, the uid drop
where root, a socket-blocking shim, and the program runs in its host work folder. The parent warns
about it loudly.
"""

import marshal
import os
import resource
import signal
import sys

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}  # SYS_pivot_root
_PR_SET_NO_NEW_PRIVS, _PR_SET_DUMPABLE, _PR_SET_PDEATHSIG = 38, 4, 1
# exit codes of a launcher failure (the parent reports them as ``sandbox_error``)
_FAIL = 125

_SOCKET_SHIM = r"""
import _socket, socket
def _no_network(*a, **k):
    raise PermissionError(1, "network access is disabled in the rlmix sandbox")
class _BlockedSocket(socket.socket):
    def __init__(self, *a, **k):
        _no_network()
socket.socket = _socket.socket = _BlockedSocket
socket.create_connection = socket.socketpair = socket.fromfd = _no_network
socket.getaddrinfo = socket.gethostbyname = _no_network
"""


def _fail(step: str, err: object) -> None:
    os.write(2, f"rlmix-sandbox-launcher: {step} failed: {err}\n".encode())
    os._exit(_FAIL)


def _libc():  # type: ignore[no-untyped-def]
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_void_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
    return libc, ctypes


def _mount(libc, ctypes, src, dst, fstype, flags, data=None):  # type: ignore[no-untyped-def]
    def enc(s):  # type: ignore[no-untyped-def]
        return None if s is None else s.encode()
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        _fail(f"mount {src} -> {dst}", os.strerror(ctypes.get_errno()))


def _bind_ro(libc, ctypes, root: str, path: str, is_dir: bool, dev: bool = False) -> None:
    target = root + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if is_dir:
        os.makedirs(target, mode=0o755, exist_ok=True)
    elif not os.path.exists(target):
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(libc, ctypes, path, target, None, _MS_BIND | _MS_REC)
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | (0 if dev else _MS_NODEV)
    _mount(libc, ctypes, None, target, None, flags)


def _build_root(cfg: dict, libc, ctypes) -> None:  # type: ignore[no-untyped-def]
    """Steps 3 of the module doc: the run's whole file system view, then ``pivot_root``."""
    root, uid = cfg["root"], cfg["uid"]
    _mount(libc, ctypes, None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount(libc, ctypes, "tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,mode=755")
    for path, is_dir in cfg["binds"]:
        _bind_ro(libc, ctypes, root, path, is_dir)
    for path in cfg["devices"]:
        _bind_ro(libc, ctypes, root, path, False, dev=True)
    for path in cfg["masks"]:  # site-packages inside the standard library folder: empty
        _mount(libc, ctypes, "tmpfs", root + path, "tmpfs",
               _MS_NOSUID | _MS_NODEV | _MS_RDONLY, "size=4k,mode=555")
    work = root + cfg["run_dir"]
    os.mkdir(work, 0o700)
    _mount(libc, ctypes, "tmpfs", work, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={cfg['disk_mb']}m,mode=700,uid={uid},gid={uid}")
    for rel, text in cfg["files"].items():
        path = os.path.join(work, rel)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    for dirpath, dirnames, filenames in os.walk(work):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            os.chown(name, uid, uid)
    _mount(libc, ctypes, None, root, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV,
           "size=4m,mode=755")
    os.chdir(root)
    # pivot_root(".", "."): the old root ends up under the new one, then is detached
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        _fail("pivot_root", f"no syscall number known for {os.uname().machine}")
    if libc.syscall(ctypes.c_long(number), b".", b".") != 0:
        _fail("pivot_root", os.strerror(ctypes.get_errno()))
    if libc.umount2(b".", _MNT_DETACH) != 0:
        _fail("detaching the host root", os.strerror(ctypes.get_errno()))
    os.chdir("/")


def _limits(cfg: dict) -> None:
    for name, soft, hard in cfg["limits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _drop(cfg: dict, libc) -> None:  # type: ignore[no-untyped-def]
    uid = cfg["uid"]
    if libc is not None:
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.umask(0o077)


def _run_program(cfg: dict) -> None:
    """Run ``main.py`` as ``__main__`` in this interpreter, as a fresh ``python main.py`` would."""
    os.environ.clear()
    os.environ.update(cfg["env"])
    if cfg["socket_shim"]:
        exec(compile(_SOCKET_SHIM, "<rlmix-socket-shim>", "exec"), {})
    sys.argv = ["main.py"] + list(cfg["argv"])
    sys.path.insert(0, os.getcwd())
    with open("main.py", "rb") as f:
        code = compile(f.read(), "main.py", "exec")
    main = type(sys)("__main__")
    main.__file__ = "main.py"
    sys.modules["__main__"] = main
    cfg.clear()
    exec(code, main.__dict__)


def main() -> None:
    path = sys.argv[1]
    try:
        with open(path, "rb") as f:
            cfg = marshal.load(f)  # marshal: built in, nothing to import (json would pull re)
        os.unlink(path)
    except (OSError, ValueError) as e:
        _fail("reading the config", e)
    try:
        for procs in cfg["cgroups"]:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
    except OSError as e:
        _fail("joining the cgroup", e)
    if cfg["mode"] != "full":
        os.chdir(cfg["workdir"])
        libc = None
        try:
            _limits(cfg)
            _drop(cfg, libc)
        except OSError as e:
            _fail("limits and uid drop", e)
        _run_program(cfg)
        return
    libc, ctypes = _libc()
    # if the trainer dies mid-run nobody enforces the timeout: die with it (the spawning thread
    # waits for this process, so "parent death" means the trainer is gone)
    trainer = os.getppid()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != trainer:
        _fail("start", "the trainer is gone")
    flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    if libc.unshare(flags) != 0:
        _fail("unshare", os.strerror(ctypes.get_errno()))
    # the program's wait status travels from PID 1 to the outer reaper through this pipe: PID 1
    # cannot end itself by a signal (the kernel ignores signals a namespace's init sends itself)
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid:  # the outer reaper, outside the new PID namespace
        os.close(status_w)
        _protect(libc)
        os.closerange(0, 3)
        own = _wait(pid)
        data = os.read(status_r, 64)
        _pass_on(int(data) if data.strip() else own)
    os.close(status_r)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by fork: set again
    try:
        _build_root(cfg, libc, ctypes)
    except OSError as e:
        _fail("building the file system view", e)
    # PID 1 of the namespace: a reaper that stays root inside the view (the program cannot
    # signal it); the program runs in its child, with ordinary signal semantics
    program = os.fork()
    if program:
        _protect(libc)
        os.closerange(0, 3)
        status = _wait(program)
        os.write(status_w, str(status).encode())
        os._exit(0)
    os.close(status_w)
    try:
        _limits(cfg)
        _drop(cfg, libc)
        os.chdir(cfg["run_dir"])
    except OSError as e:
        _fail("limits and uid drop", e)
    _run_program(cfg)


def _protect(libc) -> None:  # type: ignore[no-untyped-def]
    """A reaper: never the OOM killer's pick, not dumpable (no ptrace by the program's uid)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError:
        pass
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def _wait(pid: int) -> int:
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue


def _pass_on(status: int) -> None:
    """End this process as the program ended: the same exit code, or the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else _FAIL)

if __name__ == "__main__":
    main()
