"""Graph <-> JSON. Loading re-validates everything, whatever order the ops come in."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tapestry import dtypes
from tapestry.graph.graph import Graph, GraphError

FORMAT = "tapestry.graph/1"


def graph_to_json(graph: Graph) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "inputs": [{"name": n.name, "shape": list(n.shape), "dtype": n.dtype} for n in graph.inputs],
        "ops": [
            {"name": n.name, "op": n.op, "args": list(n.args), "params": {k: _plain(v) for k, v in n.params},
             "shape": list(n.shape)}
            for n in graph.ops
        ],
        "outputs": dict(graph.outputs),
        **({"carried": dict(graph.carried)} if graph.carried else {}),
        **({"static": sorted(graph.static)} if graph.static else {}),
        **({"nonnegative": sorted(graph.nonnegative)} if graph.nonnegative else {}),
        "constants": {name: _array_json(v) for name, v in graph.constants.items()},
        **({"examples": {name: _array_json(v) for name, v in graph.examples.items()}} if graph.examples else {}),
    }


def _array_json(value: np.ndarray) -> dict[str, Any]:
    plain = value.astype(np.float64) if value.dtype == dtypes.to_numpy("bfloat16") else value
    return {"dtype": dtypes.name_of(value.dtype), "values": plain.tolist()}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def graph_from_json(data: dict[str, Any], source: str = "<json>") -> Graph:
    """Build a graph from its JSON form; errors name the source, the op and the problem."""
    if not isinstance(data, dict):
        raise GraphError(f"{source}: not a graph: the top level is a JSON {type(data).__name__}, expected an object "
                         "with \"inputs\", \"ops\" and \"outputs\"")
    try:
        if data.get("format", FORMAT) != FORMAT:
            raise GraphError(f"format {data.get('format')!r} is not {FORMAT!r}")
        graph = Graph()
        for spec in data.get("inputs", []):
            graph.input(spec["name"], spec["shape"], spec.get("dtype", "float32"))
        pending = _ops_by_name(data.get("ops", []), graph)
        while pending:  # one pass in the recorded order adds a topologically ordered file as it stands
            before = len(pending)
            for spec in list(pending.values()):
                if not all(a in graph for a in spec.get("args", [])):
                    continue
                params = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.get("params", {}).items()}
                value = graph.op(spec["op"], *spec.get("args", []), name=spec["name"], **params)
                if "shape" in spec and tuple(spec["shape"]) != value.shape:
                    raise GraphError(
                        f"op {spec['name']!r} ({spec['op']}): recorded shape {spec['shape']} but inputs give {list(value.shape)}"
                    )
                del pending[spec["name"]]
            if len(pending) == before:
                raise GraphError(_stuck_reason(pending, graph))
        for name, target in data.get("outputs", {}).items():
            graph.output(name, target)
        for name, input_name in data.get("carried", {}).items():
            graph.carry(name, input_name)
        for name in data.get("static", []):
            if name not in graph or not graph[name].is_input:
                raise GraphError(f"static {name!r} is not an input of the graph")
            graph.static.add(name)
        for name in data.get("nonnegative", []):
            if name not in graph or not graph[name].is_input:
                raise GraphError(f"nonnegative {name!r} is not an input of the graph")
            graph.nonnegative.add(name)
        for name, spec in data.get("constants", {}).items():
            if name not in graph or not graph[name].is_input:
                raise GraphError(f"constant {name!r} is not an input of the graph")
            value = dtypes.cast(np.array(spec["values"]), spec["dtype"])
            if value.shape != graph[name].shape or spec["dtype"] != graph[name].dtype:
                raise GraphError(f"constant {name!r}: {spec['dtype']}{list(value.shape)} does not match its input "
                                 f"{graph[name].dtype}{list(graph[name].shape)}")
            graph.constants[name] = value
        for name, spec in data.get("examples", {}).items():
            graph.example(name, dtypes.cast(np.array(spec["values"]), spec["dtype"]))
        return graph
    except KeyError as err:
        raise GraphError(f"{source}: missing key {err}") from None
    except GraphError as err:
        raise GraphError(f"{source}: {err}") from None
    except (TypeError, AttributeError) as err:  # a list where an object belongs, a string for a spec...
        raise GraphError(f"{source}: malformed graph JSON: {err}") from None


def _ops_by_name(ops: list[dict[str, Any]], graph: Graph) -> dict[str, dict[str, Any]]:
    pending: dict[str, dict[str, Any]] = {}
    for k, spec in enumerate(ops):
        if not isinstance(spec, dict):
            raise GraphError(f"ops[{k}] is {spec!r}, not an object with \"name\", \"op\" and \"args\"")
        name = spec["name"]
        if name in pending or name in graph:
            raise GraphError(f"name {name!r} is defined twice")
        pending[name] = spec
    return pending


def _stuck_reason(pending: dict[str, dict[str, Any]], graph: Graph) -> str:
    """Tell a dangling reference from a cycle."""
    for spec in pending.values():
        for arg in spec.get("args", []):
            if arg not in graph and arg not in pending:
                return f"op {spec['name']!r} ({spec['op']}): input {arg!r} is not defined anywhere"
    start = next(iter(pending))
    path, seen = [start], {start}
    while True:
        nxt = next(a for a in pending[path[-1]]["args"] if a in pending)
        if nxt in seen:
            cycle = path[path.index(nxt):] + [nxt]
            return "cycle: " + " -> ".join(cycle)
        path.append(nxt)
        seen.add(nxt)


def save_graph(graph: Graph, path: str | Path) -> None:
    Path(path).write_text(json.dumps(graph_to_json(graph), indent=2) + "\n")


def load_graph(path: str | Path) -> Graph:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise GraphError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None
    return graph_from_json(data, str(path))
