"""`tapestry explain`: a plan as text, one line per step, so a reader can see why it costs what it does."""
from __future__ import annotations

from tapestry.kernels import Shape
from tapestry.plan.plan import Compute, Place, Plan, Reshard, Step
from tapestry.sharding import Block, Layout, Mesh
from tapestry.sharding.collectives import classify_reshard
from tapestry.sharding.comm import received_elements


def replicated_share(plan: Plan) -> float:
    """The share of the plan's (per-run) compute steps that every device runs on the same block."""
    computes = [s for s in plan.steps if isinstance(s, Compute) and s.out not in plan.prepared]
    if plan.mesh.size == 1 or not computes:
        return 1.0
    return sum(all(b == s.blocks[0] for b in s.blocks) for s in computes) / len(computes)


def explain(plan: Plan) -> str:
    mesh = plan.mesh
    outputs = ", ".join(f"{name}={value}" for name, value in plan.outputs.items())
    prepared = f" ({len(plan.prepared)} prepared once from static inputs)" if plan.prepared else ""
    lines = [f"plan on mesh {mesh} ({mesh.size} devices): {len(plan.steps)} steps{prepared}; outputs {outputs}"]
    width = max((len(s.out) for s in plan.steps), default=1)
    for step in plan.steps:
        head, details = _describe(step, mesh)
        if step.out in plan.prepared:
            details.append("prepared: made from static inputs alone, so run once ahead of time (0 per run)")
        lines.append(f"{step.out:<{width}}  {head}")
        lines += [f"{'':<{width}}      {d}" for d in details]
    lines.append("per device:")
    lines += [f"  {_device(k, mesh)}: {summary}" for k, summary in enumerate(_device_summaries(plan))]
    return "\n".join(lines)


def _describe(step: Step, mesh: Mesh) -> tuple[str, list[str]]:
    """The step's one-line head and its indented detail lines."""
    if isinstance(step, Place):
        return f"place    {step.input}{list(step.shape)} as {_layout(step.layout, step.shape, mesh)}", []
    if isinstance(step, Reshard):
        moved = received_elements(step.src_layout, step.layout)
        collective = classify_reshard(step.src_layout, step.layout, step.shape, mesh)
        src, dst = _layout(step.src_layout, step.shape, mesh), _layout(step.layout, step.shape, mesh)
        return f"reshard  {step.src} {src} -> {dst}: {collective}, {sum(moved)} elements moved (max {max(moved)} into one device)", []
    sig = step.signature
    args = ", ".join(f"{name}={arg}" for name, arg in zip(sig.kernel.inputs, step.args))
    params = "".join(f", {k}={v}" for k, v in step.params)
    head = f"compute  {step.kernel}({args}{params}) -> {list(step.shape)} as {_layout(step.layout, step.shape, mesh)}"
    details = [f"index blocks: {_blocks(step.blocks, mesh)}"]
    if step.kernel.startswith("opaque"):
        details.append(f"opaque: {dict(step.params)['aten']} has no Tapestry kernel; it runs whole through torch")
    if step.origin:
        details.append(f"origin: {step.origin}")
    return head, details


def _layout(layout: Layout, shape: Shape, mesh: Mesh) -> str:
    """The family name, and the blocks themselves when there is no family to name them."""
    name = layout.name(shape, mesh)
    return f"{name} [{_blocks(layout.blocks, mesh)}]" if name.endswith("blocks") else name


def _blocks(blocks: tuple[Block, ...], mesh: Mesh) -> str:
    """'all zr[...]' when every device has the same block, else each device's."""
    if len(set(blocks)) == 1 and blocks[0] is not None:
        return f"all {blocks[0]}"
    return "  ".join(f"{_device(k, mesh)} {'idle' if b is None else b}" for k, b in enumerate(blocks))


def _device(k: int, mesh: Mesh) -> str:
    return f"d{k}" if mesh.ndim == 1 else f"d{k}{mesh.coords(k)}".replace(" ", "")


def _device_summaries(plan: Plan) -> list[str]:
    """Per device: shards computed, FLOPs, and elements received, the three things a plan balances."""
    computes, flops, received = [0] * plan.mesh.size, [0.0] * plan.mesh.size, [0] * plan.mesh.size
    for step in plan.steps:
        if isinstance(step, Compute):
            for k, block in enumerate(step.blocks):
                if block is not None:
                    computes[k] += 1
                    flops[k] += step.signature.cost(block)[0]
        elif isinstance(step, Reshard):
            for k, n in enumerate(received_elements(step.src_layout, step.layout)):
                received[k] += n
    return [f"computes={c} flops={f:.3g} received={r}" for c, f, r in zip(computes, flops, received)]
