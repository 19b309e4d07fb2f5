"""CPU seconds of a command and of every process under it, those it never waited for included.

    python benchmarks/tree_cpu.py -- COMMAND ARGS...

`/usr/bin/time` counts the processes the command waited for. A forkserver (runtime/launch.py starts the ranks from
one) outlives its launcher's wait: when the launcher exits, the server is reparented, and its CPU and its ranks'
would be missed. This process becomes the subreaper of everything under it (Linux), runs the command, then waits
for every process left under it, so its children's CPU is the whole tree's. Prints `cpu USER+SYS` on stderr and
exits with the command's status.

docs/benchmarks.md ("Test suite time (make test)") cites, for a test file's CPU:

    PYTHONPATH=src python benchmarks/tree_cpu.py -- python -m pytest -q -n 0 -p no:cacheprovider tests/test_launch.py
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python benchmarks/tree_cpu.py -- COMMAND ARGS...")
    if not sys.platform.startswith("linux"):
        raise SystemExit("tree_cpu.py needs Linux (prctl PR_SET_CHILD_SUBREAPER)")
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    status = subprocess.run(argv).returncode
    while True:  # the orphans reparented to this process; a process left running keeps this waiting, as it should
        try:
            os.wait()
        except ChildProcessError:
            break
    times = os.times()
    print(f"cpu {times.children_user:.2f}+{times.children_system:.2f}", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
