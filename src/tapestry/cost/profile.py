"""Device and mesh profiles: the few numbers the built-in cost models need, kept as JSON.

A profile is data, not code, so a measured machine (`tapestry calibrate`) and a
spec sheet are interchangeable, and each records where its numbers came from.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from tapestry import dtypes

FORMAT = "tapestry.profile/1"


@dataclass(frozen=True)
class DeviceProfile:
    """One device's roofline: FLOP/s, bytes/s of memory traffic, seconds per kernel launch; and `cores`, how many
    such devices the host runs at once (0: as many as the mesh has, e.g. one GPU per rank). A mesh with more
    devices than `cores` time-shares them: every step takes `mesh.size / cores` times as long. `peaks` gives
    FLOP/s per compute dtype where it differs from `peak_flops` (tensor cores run bfloat16 far faster than
    float32); a dtype not listed runs at `peak_flops`. These are the rates the cost model prices with: a
    calibrated profile's are what the device reached, below its spec sheet's. `spec_peaks` are the spec sheet's
    FLOP/s per dtype, what MFU divides by (`mfu`), so that an MFU means the same whichever profile priced the
    step."""

    peak_flops: float
    mem_bandwidth: float
    launch_overhead: float
    cores: float = 0.0
    peaks: tuple[tuple[str, float], ...] = ()  # (dtype name, FLOP/s); "tf32" is float32 on tensor cores
    spec_peaks: tuple[tuple[str, float], ...] = ()  # (dtype name, the spec sheet's FLOP/s), for MFU only

    def peak(self, dtype: str) -> float:
        """FLOP/s of a kernel computing in `dtype`."""
        return dict(self.peaks).get(dtype, self.peak_flops)

    def spec_peak(self, dtype: str) -> float | None:
        """The spec sheet's FLOP/s for `dtype` (None: the profile gives none)."""
        return dict(self.spec_peaks).get(dtype)

    def mfu(self, flops: float, seconds: float, devices: int, dtype: str) -> float:
        """Model FLOPs utilization: `flops` done in `seconds` by `devices` such devices, over the spec sheet's
        peak for `dtype` (conventionally: a calibrated profile's measured rate would overstate it)."""
        spec = self.spec_peak(dtype)
        if spec is None:
            raise ValueError(f"MFU of {dtype}: the device profile gives no spec-sheet peak for it "
                             f"(spec_peak_flops_by_dtype lists {', '.join(n for n, _ in self.spec_peaks) or 'none'}); "
                             "MFU divides by the spec sheet's peak, not the rate the profile prices with")
        return flops / (seconds * devices * spec)

    def oversubscription(self, devices: int) -> float:
        """How much slower each of `devices` devices runs than alone: 1 until they outnumber the cores."""
        return max(1.0, devices / self.cores) if self.cores > 0 else 1.0


@dataclass(frozen=True)
class Link:
    """Alpha-beta link: a message of n bytes takes alpha + n / beta seconds."""

    alpha: float
    beta: float


@dataclass(frozen=True)
class Level:
    """One level of a network, innermost first: its link, and how many devices it joins (0: any number, as the
    outermost level does). An 8-GPU node on NVLink is Level("nvlink", Link(...), 8); the nodes on InfiniBand,
    Level("infiniband", Link(...))."""

    name: str
    link: Link
    devices: int = 0


@dataclass(frozen=True)
class Profile:
    """A device and its network. The network is either `links`, one per mesh axis or a single entry used for
    every axis, or `levels` (then `links` is empty): a hierarchy whose links the mesh's axes are mapped onto
    by their sizes (`axis_links`)."""

    name: str
    device: DeviceProfile
    links: tuple[Link, ...]
    provenance: Mapping[str, Any] = field(default_factory=dict, hash=False)
    levels: tuple[Level, ...] = ()

    def __post_init__(self) -> None:
        if not self.links and not self.levels:
            raise ValueError(f"profile {self.name!r} has no links")
        if self.links and self.levels:
            raise ValueError(f"profile {self.name!r} has both links per axis and levels; give one")
        if any(level.devices <= 0 for level in self.levels[:-1]):
            raise ValueError(f"profile {self.name!r}: every level but the outermost says how many devices it joins")

    def link(self, axis: int) -> Link:
        """The link of mesh axis `axis` of a profile with links per axis (a hierarchy needs the mesh: axis_links)."""
        if self.levels:
            raise ValueError(f"profile {self.name!r} maps mesh axes to its levels by the mesh's shape: use "
                             "axis_links(mesh.shape)")
        if len(self.links) == 1:
            return self.links[0]
        if axis >= len(self.links):
            raise ValueError(f"profile {self.name!r} describes {len(self.links)} mesh axes, not axis {axis}")
        return self.links[axis]

    def axis_links(self, shape: tuple[int, ...]) -> tuple[Link, ...]:
        """The link each axis of a mesh of `shape` communicates over. With levels, the last axis is innermost
        (consecutive ranks share a node, as torch's DeviceMesh and launchers lay them out): an axis is on the
        innermost level that joins as many devices as it and every axis inside it span together, so on 8-GPU
        nodes Mesh(2, 8) has its axis 1 on NVLink and its axis 0 on InfiniBand, and all of Mesh(2, 4) is in
        one node."""
        if not self.levels:
            return tuple(self.link(a) for a in range(len(shape)))
        links, spanned = [], 1
        for size in reversed(shape):
            spanned *= size
            level = next((lv for lv in self.levels if lv.devices == 0 or spanned <= lv.devices), None)
            if level is None:
                raise ValueError(f"profile {self.name!r} joins at most {self.levels[-1].devices} devices "
                                 f"({self.levels[-1].name}); mesh {list(shape)} has {spanned}")
            links.append(level.link)
        return tuple(reversed(links))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "name": self.name,
            "provenance": dict(self.provenance),
            "device": {
                "peak_flops": self.device.peak_flops,
                "mem_bandwidth": self.device.mem_bandwidth,
                "launch_overhead": self.device.launch_overhead,
                **({"cores": self.device.cores} if self.device.cores else {}),
                **({"peak_flops_by_dtype": dict(self.device.peaks)} if self.device.peaks else {}),
                **({"spec_peak_flops_by_dtype": dict(self.device.spec_peaks)} if self.device.spec_peaks else {}),
            },
            **({"links": [{"alpha": k.alpha, "beta": k.beta} for k in self.links]} if self.links else {}),
            **({"levels": [{"name": v.name, **({"devices": v.devices} if v.devices else {}), "alpha": v.link.alpha,
                            "beta": v.link.beta} for v in self.levels]} if self.levels else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "<json>") -> Profile:
        if data.get("format") != FORMAT:
            raise ValueError(f"{source}: not a profile (format {data.get('format')!r}, expected {FORMAT!r})")
        try:
            device = data["device"]
            return cls(
                name=str(data["name"]),
                device=DeviceProfile(
                    float(device["peak_flops"]), float(device["mem_bandwidth"]), float(device["launch_overhead"]),
                    float(device.get("cores", 0.0)), _peaks(device.get("peak_flops_by_dtype", {}), source),
                    _peaks(device.get("spec_peak_flops_by_dtype", {}), source, "spec_peak_flops_by_dtype"),
                ),
                links=tuple(Link(float(k["alpha"]), float(k["beta"])) for k in data.get("links", ())),
                provenance=dict(data.get("provenance", {})),
                levels=tuple(Level(str(v["name"]), Link(float(v["alpha"]), float(v["beta"])), int(v.get("devices", 0)))
                             for v in data.get("levels", ())),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"{source}: profile is missing or mistypes {err}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _peaks(table: Mapping[str, Any], source: str, key: str = "peak_flops_by_dtype") -> tuple[tuple[str, float], ...]:
    unknown = sorted(set(table) - {*dtypes.DTYPES, "tf32"})
    if unknown:
        raise ValueError(f"{source}: {key} names {', '.join(unknown)}; dtypes are "
                         f"{', '.join(dtypes.DTYPES)} (and tf32)")
    return tuple(sorted((name, float(value)) for name, value in table.items()))


def _shipped() -> Any:
    return resources.files("tapestry") / "profiles"


def builtin_profiles() -> list[str]:
    """Names `load_profile` accepts without a path."""
    return sorted(p.name.removesuffix(".json") for p in _shipped().iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name ('cpu-gloo'), or any profile JSON file by path."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        return Profile.from_json(json.loads(path.read_text()), str(path))
    if str(name_or_path) not in builtin_profiles():
        raise ValueError(f"no profile {str(name_or_path)!r}; built in: {', '.join(builtin_profiles())}, or give a path")
    text = (_shipped() / f"{name_or_path}.json").read_text()
    return Profile.from_json(json.loads(text), str(name_or_path))
