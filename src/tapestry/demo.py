"""`make demo`: the seeds' example, Y = ReLU(Linear(X, W, b)), evaluated whole and sharded 4 ways."""
from __future__ import annotations

import numpy as np

import tapestry
from tapestry.models import seeds_example


def main() -> None:
    g = seeds_example(batch=256, features=128, out=64)
    print(g, end="\n\n")
    inputs = tapestry.random_inputs(g, seed=0)
    whole = tapestry.evaluate(g, inputs)["y"]
    for dim_name in ("batch0", "out"):
        sig = g.signature("linear_0")
        dim = sig.dims.index(dim_name)
        parts = sig.index.split_even(dim, 4)
        sharded = tapestry.evaluate_sharded(g, inputs, {"linear_0": parts, "relu_0": parts})["y"]
        err = float(np.abs(sharded - whole).max())
        print(f"sharded 4 ways along {dim_name:6s} {', '.join(map(str, parts))}: max |diff| = {err:.2e}")
        assert err <= 1e-5, "sharded evaluation disagrees with the unsharded program"
    print("sharded and unsharded evaluations agree")


if __name__ == "__main__":
    main()
