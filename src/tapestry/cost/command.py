"""`tapestry cost` (a kernel's cost formulas and its candidate partitions' times) and `tapestry calibrate`."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import sympy
from rich.console import Console
from rich.table import Table

from tapestry.cli import UserError
from tapestry.cost import DefaultCostModel, load_profile
from tapestry.kernels import KernelError, ParamValue, Signature, get_kernel
from tapestry.plan.plan import Reshard
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.partition import candidate_partitions, output_layout


def register(subparsers: Any) -> None:
    cost = subparsers.add_parser(
        "cost",
        help="show a kernel's FLOP and byte formulas and the predicted time of each candidate partition",
        description="Print the sympy cost formulas of KERNEL bound to --shapes; with --mesh, price every "
        "candidate partition on the --profile.",
    )
    cost.add_argument("--symbolic", metavar="KERNEL", required=True, help="kernel name, e.g. linear")
    cost.add_argument("--shapes", required=True, help="input shapes, e.g. 64x128,128x32,32")
    cost.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                      help="kernel param (repeatable); a tuple is comma-separated: perm=1,0")
    cost.add_argument("--mesh", type=Mesh.parse, help="mesh, e.g. 4 or 2x2")
    cost.add_argument("--profile", default="cpu-gloo", help="built-in profile name or JSON path")
    cost.set_defaults(func=run_cost)

    calibrate = subparsers.add_parser(
        "calibrate",
        help="measure this machine (one core per device, gloo on loopback; or GPUs and nccl) into a profile JSON",
    )
    calibrate.add_argument("-o", "--output", type=Path, required=True,
                           help="profile JSON to write; on --device cuda its name is the profile's name")
    calibrate.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                           help="cpu: one core per device, gloo links; cuda: one GPU per device, nccl links")
    calibrate.add_argument("--quick", action="store_true", help="a few seconds of tiny measurements (smoke test)")
    calibrate.set_defaults(func=run_calibrate)


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """'64x128,128x32,32' -> [(64, 128), (128, 32), (32,)]; '' or 'scalar' is a 0-d shape."""
    try:
        return [tuple(int(d) for d in part.split("x")) if part not in ("", "scalar") else ()
                for part in text.split(",")]
    except ValueError:
        raise UserError(f"--shapes {text!r} is not like 64x128,128x32,32") from None


def parse_param(text: str) -> tuple[str, ParamValue]:
    name, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return name, tuple(int(v) for v in value.split(",") if v) if "," in value else int(value)
    except ValueError:
        raise UserError(f"--param {text!r} is not like axis=1 or perm=1,0") from None


def bind(args: argparse.Namespace) -> Signature:
    try:
        return get_kernel(args.symbolic).bind(parse_shapes(args.shapes), dict(map(parse_param, args.param)))
    except KernelError as err:
        raise UserError(str(err)) from None


def partition_table(sig: Signature, mesh: Mesh, model: DefaultCostModel) -> Table:
    """Each candidate's compute time, and what turning its output replicated would add."""
    table = Table(title=f"{sig} on mesh {mesh}, profile {model.profile.name}")
    for column in ("partition", "largest shard", "flops", "bytes", "compute µs", "output", "to R µs", "total µs"):
        table.add_column(column, justify="left" if column in ("partition", "output") else "right", no_wrap=True)
    replicated = Layout.replicated(sig.output_shape, mesh)
    for part in candidate_partitions(sig, mesh):
        shard = max((b for b in part.blocks if b is not None), key=lambda b: b.size)
        flops, nbytes = sig.cost(shard)
        compute = model.roofline.shard_time(sig, shard)
        out = output_layout(sig, part)
        gather = model.comm.reshard_time(Reshard("to_r", "out", sig.output_shape, out, replicated), mesh)
        micros = [f"{t * 1e6:,.1f}" for t in (compute, gather, compute + gather)]
        table.add_row(part.name(sig), "x".join(map(str, shard.shape)), f"{flops:.3g}", f"{nbytes:.3g}",
                      micros[0], out.name(sig.output_shape, mesh), *micros[1:])
    return table


def run_cost(args: argparse.Namespace) -> int:
    sig = bind(args)
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 160  # piped or captured: do not squeeze the table to 80 columns
    sizes = dict(zip(sig.symbols, sig.spec.sizes))
    console.print(str(sig), markup=False)
    console.print(f"index dims: {', '.join(f'{d}={s}' for d, s in zip(sig.dims, sig.spec.sizes))}", markup=False)
    for label, expr in (("flops", sig.flops_expr), ("bytes", sig.bytes_expr)):
        console.print(f"{label} = {sympy.sstr(sympy.expand(expr))}  (= {int(expr.subs(sizes)):,} unsharded)",
                      markup=False)
    if args.mesh is not None:
        console.print(partition_table(sig, args.mesh, DefaultCostModel(load_profile(args.profile))))
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from tapestry.cost.calibrate import calibrate, calibrate_cuda  # imports torch.distributed: only when calibrating

    command = f"tapestry calibrate -o {args.output}" + (" --device cuda" if args.device == "cuda" else "") + (
        " --quick" if args.quick else "")
    if args.device == "cuda":
        profile = calibrate_cuda(command, args.output.stem, quick=args.quick)
    else:
        profile = calibrate(command, quick=args.quick)
    profile.save(args.output)
    device, link = profile.device, profile.links[0]
    Console(stderr=True, highlight=False).print(
        f"wrote {args.output}: peak {device.peak_flops / 1e9:.1f} GFLOP/s, memory {device.mem_bandwidth / 1e9:.1f} GB/s, "
        f"launch {device.launch_overhead * 1e6:.2f} µs, {device.cores:.2f} cores, link alpha {link.alpha * 1e6:.1f} µs, "
        f"beta {link.beta / 1e9:.3f} GB/s"
    )
    return 0
