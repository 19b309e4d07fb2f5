"""What a rank says when it stops mid-call outside `tapestry.launch` (torchrun, or the user's own launcher).

torchrun's agent SIGTERMs every surviving rank when one fails. A survivor is then usually blocked inside a gloo
(or nccl) collective, waiting for the rank that died, and CPython runs a Python signal handler only when the main
thread gets back to the interpreter, which it does not while blocked in C++. So the handler's work is done by a
watchdog thread, woken through `signal.set_wakeup_fd`: CPython's C-level handler writes the signal's number to
a pipe from whichever thread the kernel interrupted, and the blocked collective releases the GIL. The watchdog
writes one line to stderr, `tapestry: rank 0 stopped by SIGTERM in call 3 of its parallel program; rank 1 (pid
4242 on this host) had already exited`, and ends the process with status 128 + SIGTERM without unwinding (which
could block in the same collective): it ends within torchrun's grace period, as SIGTERM's default action would.
The call is the one `note_call` last recorded (two assignments per call; nothing is sent anywhere per call).
The rank that failed is found from each rank's host and pid, put once in the process group's store: a local
rank whose process is gone (or a zombie) is named. faulthandler could dump the stacks but not name the call; a
short gloo timeout would also cut long compiles and steps, and still come after torchrun's SIGTERM.

An exception that ends the process outside a call (a collective of `dcp.save` failing because a peer died)
gets the same line, `tapestry: rank 0 stopped by RuntimeError after call 5 ...`, before its traceback
(`sys.excepthook`, chained to the one torch installed).

The watchdog is installed only where SIGTERM has its default action and no wakeup fd is set (a user's own
handler, or an asyncio loop's, is left alone) and never in a rank `tapestry.launch` forked (its supervisor
names the rank and the call).
"""
from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tapestry.spmd import launch

PEER_LOOKUP_S = 2.0  # at most this long to find which ranks had exited: torchrun waits 30 s before SIGKILL

_rank: int | None = None  # this process's rank once the watchdog is installed
_call = -1  # the call this rank last began (0-based), -1 before any
_running = False  # whether that call is still running
_stopping = threading.Lock()


def note_call(call: int) -> None:
    """A parallel program starts its call `call` (0-based) on this rank."""
    global _call, _running
    _call, _running = call, True
    launch.note_call(call)


def note_done() -> None:
    """The call `note_call` recorded has returned."""
    global _running
    _running = False


def where() -> str:
    """Where this rank is in its calls, for a stop message: "in call 3", "after call 2", "before its first call"."""
    if _call < 0:
        return "before its first call"
    return f"in call {_call}" if _running else f"after call {_call}"


def watch_sigterm(rank: int) -> None:
    """Make a SIGTERM name this rank and its call on stderr (module docstring); once per process, from the main
    thread. Every rank of the default process group calls it (it puts this rank's host and pid in the store)."""
    global _rank
    if _rank is not None or launch.forked() or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if previous != -1:  # someone else's (an event loop's): theirs to handle
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return
    _rank = rank
    dist.distributed_c10d._get_default_store().set(_pid_key(rank), f"{socket.gethostname()} {os.getpid()}")
    # the C-level handler wakes the watchdog wherever the main thread is; the Python-level one has nothing to do
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    threading.Thread(target=_watch, args=(read,), name="tapestry-sigterm", daemon=True).start()
    os.register_at_fork(after_in_child=functools.partial(_forget, sys.excepthook))
    if not (sys.flags.interactive or hasattr(sys, "ps1")):  # at a prompt an uncaught exception stops nothing
        sys.excepthook = functools.partial(_uncaught, sys.excepthook)


def _uncaught(previous: Callable[..., Any], kind: type[BaseException], error: BaseException,
              trace: types.TracebackType | None) -> None:
    """An error outside a call (dcp.save's collective failing when a peer died, say) names the call too; a
    SIGTERM meanwhile (torchrun stopping this rank) waits until the traceback is out."""
    with _stopping:
        _say(f"stopped by {kind.__name__}", wait=0.5)
        previous(kind, error, trace)


def _forget(excepthook: Callable[..., Any]) -> None:
    """In a child forked from this rank (a DataLoader worker, say) there is no watchdog thread: SIGTERM gets its
    default action back, and the excepthook its previous one."""
    global _rank
    if _rank is None:
        return
    _rank = None
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.excepthook = excepthook


def _watch(read: int) -> None:
    while True:
        woken = os.read(read, 64)
        if not woken:
            return
        if signal.SIGTERM in woken:
            _stop()


def _stop() -> None:
    """Say where this rank stopped, then end the process as SIGTERM would (after an uncaught exception's
    traceback, if one is being printed)."""
    _stopping.acquire()
    _say("stopped by SIGTERM", wait=0.0)
    os._exit(128 + signal.SIGTERM)


def _say(what: str, wait: float) -> None:
    """One line on stderr: this rank, `what` stopped it, its call, and the ranks of this host already gone."""
    gone = exited_peers(wait)
    line = f"tapestry: rank {_rank} {what} {where()} of its parallel program{'; ' + gone if gone else ''}\n"
    os.write(2, line.encode())  # not sys.stderr: the main thread may hold its lock


def exited_peers(wait: float = 1.0) -> str:
    """The ranks of this host whose processes had exited, as "rank 1 (pid 4242 on this host) had already exited",
    or "" where none had (or none could be looked up within PEER_LOOKUP_S). `wait`: how long to watch for one to
    exit (a rank that saw a peer's socket close may look before the kernel has finished that peer)."""
    found: list[str] = []
    looker = threading.Thread(target=_look_for_exited, args=(wait, found), daemon=True)
    looker.start()
    looker.join(PEER_LOOKUP_S + wait)
    return found[0] if found else ""


def _look_for_exited(wait: float, found: list[str]) -> None:
    if _rank is None or not dist.is_initialized():  # no watchdog, so no pids in the store
        return
    store, host = dist.distributed_c10d._get_default_store(), socket.gethostname()
    pids = {}
    for rank in range(dist.get_world_size()):
        key = _pid_key(rank)
        if store.check([key]):
            peer_host, pid = store.get(key).decode().split()
            if peer_host == host and int(pid) != os.getpid():
                pids[rank] = int(pid)
    for _ in range(1 + int(wait / 0.05)):
        gone = [f"rank {r} (pid {pid} on this host)" for r, pid in pids.items() if _exited(pid)]
        if gone:
            found.append(f"{', '.join(gone)} had already exited")
            return
        time.sleep(0.05)


def _exited(pid: int) -> bool:
    """Whether process `pid` is gone or a zombie (dead, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return False


def _pid_key(rank: int) -> str:
    return f"tapestry/pid/{rank}"
