"""The program a sandboxed verification runs (``main.py``), standard library only.

It is sent as text: the package is not in the sandbox's view. Its job arrives on stdin (one JSON
line), never in a file of the run folder. Nothing it reports is trusted by the parent except as
data: the verdict is decided outside (see ``rlmix_code.judge``).

``mode == "calls"`` (the split path): load the solution, call the entry point with each recorded
argument list and write ``R <i> <value>`` (the return value as a plain literal in the tagged JSON
of ``rlmix_code.judge``) or ``E <i> <reason>`` (it raised, returned a non-plain value, or timed
out) to the result fd.

``mode == "check"`` (the nonce path, for checks that cannot be split): for each test this process
(R) forks a child (C); C closes stdin before any solution code runs, points fds 1 and 2 at
``/dev/null``, runs the solution, undoes its changes to ``builtins``, runs the test program in a
namespace of the prompt's own definitions with the entry point behind a guard that refuses
non-plain return values, and on success writes ``done`` to a pipe and exits 0. Only after the
last C has ended does R read the nonce (the bytes after the job on stdin, read unbuffered), so
no C ever holds it. R writes ``<nonce> <k> passed`` only when C wrote ``done`` AND C's exit
status, observed by R, is 0. What the nonce path cannot hide: the test itself is in C's memory
(a frame oracle can read it) and C may patch builtins during its own call.
"""

import json
import os
import signal
import sys


class _CallTimeout(BaseException):
    pass


def _alarm(*_):  # type: ignore[no-untyped-def]
    raise _CallTimeout()


class _NotPlain(Exception):
    pass


def _encode(x, depth=0):  # type: ignore[no-untyped-def]
    """A plain value as tagged JSON; anything else (a subclass, an object) is refused."""
    if depth > 200:
        raise _NotPlain("nested deeper than 200")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return {"i": format(x, "x")}
    if t is float:
        return {"f": repr(x)}
    if t is complex:
        return {"c": [repr(x.real), repr(x.imag)]}
    if t is bytes:
        return {"b": x.hex()}
    if t is list or t is tuple or t is set or t is frozenset:
        tag = {list: "l", tuple: "t", set: "s", frozenset: "z"}[t]
        return {tag: [_encode(v, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in x.items()]}
    raise _NotPlain(f"returned a {t.__module__}.{t.__qualname__}, not a plain value")


def _decode(x):  # type: ignore[no-untyped-def]
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, dict) and len(x) == 1:
        (tag, v), = x.items()
        if tag == "i":
            return int(v, 16)
        if tag == "f":
            return float(v)
        if tag == "c":
            return complex(float(v[0]), float(v[1]))
        if tag == "b":
            return bytes.fromhex(v)
        if tag == "l":
            return [_decode(e) for e in v]
        if tag == "t":
            return tuple(_decode(e) for e in v)
        if tag == "s":
            return {_decode(e) for e in v}
        if tag == "z":
            return frozenset(_decode(e) for e in v)
        if tag == "d":
            return {_decode(k): _decode(e) for k, e in v}
    raise ValueError(f"not a tagged value: {x!r:.80}")


class _Sink:
    """Where the solution's prints go: nowhere (a chatty solution cannot fill memory)."""

    def write(self, s):  # type: ignore[no-untyped-def]
        return len(s)

    def flush(self):  # type: ignore[no-untyped-def]
        pass


def _describe(e):  # type: ignore[no-untyped-def]
    if isinstance(e, _CallTimeout):
        return "call timed out"
    try:
        return (type(e).__name__ + ": " + str(e))[:300]
    except BaseException:  # a hostile __str__
        return type(e).__name__


def _calls(job):  # type: ignore[no-untyped-def]
    out = os.dup(1)
    null = os.open("/dev/null", os.O_WRONLY)
    os.dup2(null, 1)
    sys.stdout = _Sink()

    def report(line):  # type: ignore[no-untyped-def]
        data = (line + "\n").encode("utf-8", "replace")
        while data:
            data = data[os.write(out, data):]

    signal.signal(signal.SIGALRM, _alarm)
    namespace = {"__name__": "solution"}
    try:
        signal.setitimer(signal.ITIMER_REAL, job["timeout_s"])
        exec(compile(job["solution"], "solution.py", "exec"), namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
        fn = namespace[job["entry_point"]]
    except BaseException as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        report("L " + json.dumps(_describe(e)))
        return
    for i, call in enumerate(job["calls"]):
        args, kwargs = _decode(call)
        try:
            signal.setitimer(signal.ITIMER_REAL, job["timeout_s"])
            value = fn(*args, **kwargs)
            signal.setitimer(signal.ITIMER_REAL, 0)
            line = f"R {i} " + json.dumps(_encode(value))
        except BaseException as e:
            signal.setitimer(signal.ITIMER_REAL, 0)
            line = f"E {i} " + json.dumps(_describe(e))
        sys.stdout = _Sink()
        report(line)


def _plain_guard(fn):  # type: ignore[no-untyped-def]
    """The candidate as the test sees it on the nonce path: a call whose value is not plain
    (an always-equal object, a subclass of int/str/list) fails the test."""
    def candidate(*args, **kwargs):  # type: ignore[no-untyped-def]
        value = fn(*args, **kwargs)
        _encode(value)
        return value
    return candidate


def _one_test(job, test, done_w):  # type: ignore[no-untyped-def]
    """C: runs in a fresh fork, with no stdin and no stdout; reports ``done`` on success."""
    import builtins
    os.close(0)
    sys.stdin = None
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)
    sys.stdout = sys.stderr = _Sink()
    signal.signal(signal.SIGALRM, _alarm)
    pristine = dict(builtins.__dict__)
    solution = {"__name__": "solution"}
    tests = {"__name__": "test"}
    try:
        signal.setitimer(signal.ITIMER_REAL, job["timeout_s"])
        exec(compile(job["solution"], "solution.py", "exec"), solution)
        # what the solution changed at load is undone; the test's helpers come from the prompt
        # (the solution may redefine them); the test sees the entry point through the guard
        for name in set(builtins.__dict__) - set(pristine):
            del builtins.__dict__[name]
        builtins.__dict__.update(pristine)
        exec(compile(job["prompt"], "prompt.py", "exec"), tests)
        tests[job["entry_point"]] = _plain_guard(solution[job["entry_point"]])
        exec(compile(test, "test.py", "exec"), tests)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException:
        os._exit(1)
    os.write(done_w, b"done")
    os._exit(0)


def _check(job):  # type: ignore[no-untyped-def]
    outcomes = []
    for test in job["tests"]:
        done_r, done_w = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(done_r)
            _one_test(job, test, done_w)
        os.close(done_w)
        got = b""
        while len(got) <= 64:
            chunk = os.read(done_r, 64)
            if not chunk:
                break
            got += chunk
        os.close(done_r)
        while True:
            try:
                status = os.waitpid(child, 0)[1]
                break
            except InterruptedError:
                continue
        if got == b"done" and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            outcomes.append("passed")
        elif os.WIFSIGNALED(status):
            outcomes.append(f"failed ended by signal {os.WTERMSIG(status)}")
        else:
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
            outcomes.append(f"failed exit code {code}"
                            + ("" if got == b"done" else ", no completion report"))
    # only now, with every C gone, does R read the nonce
    nonce = _read_exactly(64).decode("ascii", "replace").strip()
    for k, outcome in enumerate(outcomes):
        print(nonce, k, outcome, flush=True)


def _read_exactly(n):  # type: ignore[no-untyped-def]
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def main():  # type: ignore[no-untyped-def]
    # unbuffered reads of exactly the job: a buffered stdin would already hold the nonce that
    # follows it (and C would inherit that buffer)
    header = b""
    while not header.endswith(b"\n") and len(header) < 20:
        header += os.read(0, 1)
    job = json.loads(_read_exactly(int(header)).decode("utf-8"))
    (_calls if job["mode"] == "calls" else _check)(job)


main()
