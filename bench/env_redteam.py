"""Red-team tables of the tools env's python tool and of the sql env: each hack run by the code at
a git revision ("before") and by the working tree ("now").

    OMP_NUM_THREADS=1 python bench/env_redteam.py --before 49828e7

tools: a hack "worked" when its marker shows in the tool's output (a leak, an escape, a
persisted file, a connection, a cap exceeded) or the call outlived its timeout by 5 s.
sql: a hack "worked" when the query ran to an answer instead of being refused, took longer than
5 s, or grew the process by more than 100 MB.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/envs/sql/tests"))

from code_verify import _module_at  # noqa: E402


def tools_table(before: str) -> None:
    import rlmix_sandbox as new
    from rlmix_tools import Settings
    from rlmix_tools.redteam import TOOL_HACKS
    old = _module_at(before, "core/rlmix/sandbox.py", "rlmix_bench_old_sandbox")
    s = Settings()
    folder = Path(tempfile.mkdtemp(prefix="rlmix-host-"))
    os.chmod(folder, 0o755)
    secret = folder / "answers.txt"
    secret.write_text("RLMIX-SECRET 448819\n")
    os.chmod(secret, 0o644)
    host = {"secret_file": str(secret), "socket_path": str(folder / "trainer.sock"),
            "abstract": f"\0rlmix-bench-{os.getpid()}"}
    servers = []
    for address in (host["socket_path"], host["abstract"]):
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(address)
        if not address.startswith("\0"):
            os.chmod(address, 0o777)  # as many daemons' sockets are: anyone may connect
        srv.listen(8)
        servers.append(srv)
    print("| python-tool hack | worked before | works now |")
    print("| --- | --- | --- |")
    for hack in TOOL_HACKS:
        cells = []
        for module in (old, new):
            kw = {"timeout_s": 20.0, "memory_mb": s.python_memory_mb,
                  "max_output_bytes": 4 * s.max_tool_chars}
            if hack.name == "state across calls":
                module.run_python(hack.code(**host), **kw)
            r = module.run_python(hack.code(**host), **kw)
            worked = hack.marker in r.stdout + r.stderr or r.duration_s > 25
            cells.append("**yes**" if worked else "no")
        print(f"| {hack.name} | {cells[0]} | {cells[1]} |")
    for srv in servers:
        srv.close()


def sql_table(before: str) -> None:
    import rlmix_sql.execute as new
    from rlmix_sql.schemas import build_database
    from test_sql_redteam import HACKS
    old = _module_at(before, "plugins/envs/sql/rlmix_sql/execute.py", "rlmix_bench_old_execute")
    db = build_database("company", 7, Path(tempfile.mkdtemp()))
    print("| sql hack | got through before | gets through now | now |")
    print("| --- | --- | --- | --- |")
    for name, query in HACKS:
        cells, reason = [], ""
        for module in (old, new):
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            t = time.monotonic()
            r = module.run_query(db.path, query, timeout_ms=500)
            slow = time.monotonic() - t > 5
            grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss > 100_000
            ran = r.rows is not None and "count(*)" not in query
            cells.append("**yes**" if ran or slow or grew else "no")
            reason = r.error or f"{len(r.rows or [])} rows"
        print(f"| {name} | {cells[0]} | {cells[1]} | {reason[:70]} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", default="49828e7")
    args = ap.parse_args()
    tools_table(args.before)
    print()
    sql_table(args.before)


if __name__ == "__main__":
    main()
