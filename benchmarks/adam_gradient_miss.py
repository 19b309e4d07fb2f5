"""Why one parameter's Adam step misses torch's: the gradient at its worst element, the import's and torch's.

    .venv/bin/python benchmarks/adam_gradient_miss.py FAMILY PARAMETER [--lr 1e-3]

Adam's first step moves each element by lr * g / (|g| + eps): where |g| is a few eps, an absolute gradient miss is
multiplied by lr * eps / (|g| + eps)**2 (thousands at lr 1e-3, eps 1e-8). The import's gradient is read from its
SGD step at lr 1; torch's in float32 and float64. A gradient miss of the order of torch's own float32 rounding
(the parameter's largest) says rounding, amplified; a wrong gradient misses by far more.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

import tapestry
from tapestry.evaluator import evaluate
from tapestry.importer.zoo import FAMILIES
from tapestry.testing.versus_torch import Case, case_of, torch_gradients, torch_step


def imported_step(case: Case, training: tapestry.Training) -> dict[str, np.ndarray]:
    imported = tapestry.from_torch(case.module, case.inputs, training=training, verbose=False)
    values = imported.outputs(evaluate(imported.graph, imported.inputs(*case.inputs)))["parameters"]
    return {path: np.asarray(value, np.float64) for path, value in values.items()}


def torch_gradient(case: Case, path: str, dtype: torch.dtype) -> np.ndarray:
    return torch_gradients(case, dtype)[1][path].double().numpy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("family")
    parser.add_argument("parameter")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    case = case_of(*FAMILIES[args.family].build())
    before = dict(case.module.named_parameters())[args.parameter].detach().double().numpy()
    adam = tapestry.Training(loss=case.loss, optimizer="adam", lr=args.lr)
    ours = imported_step(case, adam)[args.parameter]
    ours_gradient = before - imported_step(case, tapestry.Training(loss=case.loss, optimizer="sgd", lr=1.0))[
        args.parameter]
    single, exact = (torch_gradient(case, args.parameter, dtype) for dtype in (torch.float32, torch.float64))
    want = torch_step(case, adam, torch.float32)[1][args.parameter]
    miss = np.abs(ours - want)
    at = np.unravel_index(miss.argmax(), miss.shape)
    amplification = args.lr * adam.eps / (abs(exact[at]) + adam.eps) ** 2
    print(f"worst element {tuple(int(i) for i in at)}: step miss {miss[at]:.3g} "
          f"(largest update {np.abs(want - before).max():.3g})")
    print(f"its gradient: import {ours_gradient[at]:.4g}, torch float32 {single[at]:.4g}, float64 {exact[at]:.4g} "
          f"(eps {adam.eps:g}; Adam multiplies a gradient miss there by {amplification:.3g})")
    print(f"the parameter's largest gradient miss of float64: import {np.abs(ours_gradient - exact).max():.3g}, "
          f"torch float32 {np.abs(single - exact).max():.3g}")


if __name__ == "__main__":
    main()
