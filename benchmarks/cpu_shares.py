"""Shares of a planning call's CPU time by the functions on its stack, sampled (SIGPROF), around any script.

    python benchmarks/cpu_shares.py [--within optimize] [--frames NAME ...] [--top 15] [--interval-ms 2] \\
        -- SCRIPT.py ARGS...

Runs SCRIPT with a process-CPU-time timer (ITIMER_PROF, every `--interval-ms` of CPU, so a loaded machine does not
skew it) whose handler takes the main thread's stack. Each sample is weighted by the process CPU seconds since the
previous one: a long call into C (egglog's run, CP-SAT's solve, numpy) delivers its signals only when it returns,
and its seconds then go to the stack that made it. Only samples with a `--within` frame on the stack count. A
function's share is the CPU seconds of the samples with it on the stack (inclusive, once per sample however
deep it recurses) over the seconds within. Frames are named `PATH:QUALNAME` with PATH under src/tapestry (or the
file's name elsewhere); a `--frames`/`--within` NAME matches the whole name or its QUALNAME. Prints the named
frames' shares, then the `--top` tapestry functions by share, then one JSON line of it all.

docs/benchmarks.md ("Grid counts once per source and device") cites:

    python benchmarks/cpu_shares.py -- benchmarks/phases.py --model phi --mesh 2x2 --extractor ilp --optimize
"""
from __future__ import annotations

import argparse
import json
import runpy
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType

PACKAGE = "/src/tapestry/"
# Where phi5 found Phi's pricing time going (docs/benchmarks.md): pricing, the reshards, their groups, their
# send/recv counts, the moves planned for them, the translation to the blocks' box; saturation and the ILP.
FRAMES = ("Decoder.extraction_graph", "AlphaBeta._priced", "reshard_groups", "received_counts", "transfers",
          "translated", "explore", "saturate", "extract_ilp")


def frame_name(code: CodeType) -> str:
    """`cost/comm.py:AlphaBeta._priced` for tapestry's code, `FILE.py:QUALNAME` for any other."""
    path = code.co_filename
    where = path.split(PACKAGE, 1)[1] if PACKAGE in path else Path(path).name
    return f"{where}:{code.co_qualname}"


def matches(name: str, wanted: str) -> bool:
    return name == wanted or name.split(":", 1)[1] == wanted


class Sampler:
    """Inclusive CPU seconds per frame name and per wanted name, of the samples with a `within` frame on the main
    thread's stack."""

    def __init__(self, within: str, wanted: list[str], interval: float) -> None:
        self.within, self.wanted, self.interval = within, wanted, interval
        self.seconds: Counter[str] = Counter()  # by frame name
        self.wanted_seconds: Counter[str] = Counter()  # by wanted name: a sample counts once however many match
        self.total = 0.0
        self.ours: set[str] = set()  # the names of tapestry's frames
        self._names: dict[CodeType, tuple[str, tuple[str, ...]]] = {}  # a frame's name and the wanted it matches
        self._last = time.process_time()

    def start(self) -> None:
        signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, self.interval, self.interval)

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, signal.SIG_DFL)

    def _sample(self, signum: int, frame: FrameType | None) -> None:
        now = time.process_time()
        spent, self._last = now - self._last, now
        names, found = set(), set()
        while frame is not None:
            code = frame.f_code
            known = self._names.get(code)
            if known is None:
                name = frame_name(code)
                known = self._names[code] = name, tuple(w for w in [self.within, *self.wanted] if matches(name, w))
                if PACKAGE in code.co_filename:
                    self.ours.add(name)
            names.add(known[0])
            found.update(known[1])
            frame = frame.f_back
        if self.within in found:
            self.total += spent
            self.seconds.update(dict.fromkeys(names, spent))
            self.wanted_seconds.update(dict.fromkeys(found, spent))

    def share(self, name: str) -> float:
        """The share of the seconds within spent with the wanted `name` on the stack."""
        return self.wanted_seconds[name] / self.total if self.total else 0.0


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        argv.append("--help")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--within", default="optimizer.py:optimize", help="count only samples inside this frame")
    parser.add_argument("--frames", nargs="+", default=list(FRAMES), help="frames whose shares to print")
    parser.add_argument("--top", type=int, default=15, help="also print this many tapestry functions by share")
    parser.add_argument("--interval-ms", type=float, default=2.0, help="CPU milliseconds between samples")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    script = argv[argv.index("--") + 1:]
    sampler = Sampler(args.within, args.frames, args.interval_ms / 1e3)
    sys.argv = script
    # The handler runs on top of whatever stack a signal lands on: transformers' lazy import of torch._dynamo (Mixtral)
    # is deep enough that its frames then passed Python's default limit of 1000 (a RecursionError in the import).
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 4000))
    sampler.start()
    try:
        runpy.run_path(script[0], run_name="__main__")
    finally:
        sampler.stop()
    shares = {name: round(sampler.share(name), 4) for name in args.frames}
    top = [(name, round(s / sampler.total, 4)) for name, s in sampler.seconds.most_common()
           if name in sampler.ours][:args.top] if sampler.total else []
    print(f"{sampler.total:.2f} CPU s sampled within {args.within}")
    for name, share in [*shares.items(), ("--", None), *top]:
        print("--" if share is None else f"{100 * share:6.1f}%  {name}")
    print(json.dumps({"within": args.within, "cpu_s": round(sampler.total, 3), "frames": shares, "top": top}))


if __name__ == "__main__":
    main()
