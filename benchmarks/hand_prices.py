"""benchmarks/cluster.py's hand plans alone (no search): each one's predicted ms, peak GiB per device and its dearest
phase/kind of time, per case (issue 24: Mixtral's ZeRO-3 priced 5.3 s on 8x8, nearly all forward send/recv).

    python benchmarks/hand_prices.py --models 7B,Mixtral --meshes 8,8x8

Cases are cluster.py's (transformers' models at real widths under torch.device("meta"), a training step of
--layers layers, batch 8 x 2048, the gpu-h100-cluster profile), each imported and priced in this process, one
after another; prints one line per hand plan and the process's CPU s.
"""
from __future__ import annotations

import argparse
import time

from cluster import PROFILE, Case, build, hand_plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="7B,Mixtral")
    parser.add_argument("--meshes", default="8,8x8")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()

    from tapestry.cost import DefaultCostModel, load_profile

    model = DefaultCostModel(load_profile(PROFILE))
    started = time.process_time()
    for name in args.models.split(","):
        for mesh in args.meshes.split(","):
            case = Case(name, args.layers, "training", mesh, args.batch, args.seq)
            errors: dict[str, str] = {}
            breakdowns: dict[str, dict[str, float]] = {}
            priced = hand_plans(build(case), case, model, errors, breakdowns)
            for hand, (seconds, peak) in priced.items():
                kinds = {k: v for k, v in breakdowns.get(hand, {}).items() if k != "model"}
                dearest = max(kinds, key=kinds.get, default="")
                where = f", dearest {dearest} {kinds[dearest] * 1e3:.1f} ms" if dearest else ""
                print(f"{name} {mesh} {hand}: {seconds * 1e3:.1f} ms, {peak / 2**30:.2f} GiB{where}"
                      + (f" ({errors[hand]})" if hand in errors else ""), flush=True)
    print(f"CPU {time.process_time() - started:.1f} s")


if __name__ == "__main__":
    main()
