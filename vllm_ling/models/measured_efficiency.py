"""Efficiency factors measured on a GPU, for the byte cost model (``cost_model``).

The byte model gives a floor: bytes per step over the device bandwidth. Real steps reach a
fraction of it (or, modelled in two terms, the floor plus a cost per kernel launch), per op class: ``benchmarks/decode_step.py`` measures, for a whole Ling decode
step in one CUDA graph, the time of each op class and the bytes it must move, next to the copy
bandwidth of the same run, and writes them as JSON (``--json``; the committed H200 run is
``benchmarks/results/decode_step_h200.json``). This module reads such a file into factors a
prediction can use and cite: which file, which token count, which composition, which device.
Nothing here is a measured number; every number comes from the file. No vLLM or torch import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class EfficiencyFileError(ValueError):
    """A decode_step result file that cannot give the factors asked for (names the file)."""


@dataclass(frozen=True)
class ClassEfficiency:
    us: float          # time of the class's ops alone in one step
    bytes: float       # bytes the class must move in one step (0 when it moves only activations)

    def fraction(self, copy_gbs: float) -> float | None:
        """Fraction of the copy bandwidth the class reached (None when it moves no counted bytes)."""
        if not self.bytes or self.us <= 0:
            return None
        return self.bytes / (self.us * 1e-6) / (copy_gbs * 1e9)


@dataclass(frozen=True)
class MeasuredEfficiency:
    source: str
    device: str
    copy_gbs: float
    tokens: int
    composition: str
    step_us: float
    step_bytes: float
    launches: int
    classes: dict[str, ClassEfficiency] = field(default_factory=dict)

    @property
    def step_fraction(self) -> float:
        """The whole step's bytes (the byte model's count) over its time, as a fraction of the
        copy bandwidth: the factor that turns a byte-model floor into a predicted step time."""
        return self.step_bytes / (self.step_us * 1e-6) / (self.copy_gbs * 1e9)

    def predict_us(self, step_bytes: float, bandwidth_gbs: float) -> float:
        """A step of ``step_bytes`` on a device of ``bandwidth_gbs`` at this run's efficiency."""
        return step_bytes / (bandwidth_gbs * 1e9 * self.step_fraction) * 1e6

    @property
    def launch_overhead_us(self) -> float | None:
        """The step's time above its bytes at the copy bandwidth, per kernel launch: what launch,
        ramp, tail and serial latency cost per launch on the measured device (None without a
        launch count). The second term of :meth:`predict_with_launches_us`."""
        if self.launches <= 0:
            return None
        floor_us = self.step_bytes / (self.copy_gbs * 1e9) * 1e6
        return (self.step_us - floor_us) / self.launches

    def predict_with_launches_us(self, step_bytes: float, bandwidth_gbs: float) -> float | None:
        """A step of ``step_bytes`` on a device of ``bandwidth_gbs`` as its bytes at that bandwidth
        plus this run's launches at this run's per-launch overhead: on a slower memory system the
        bytes grow and the launch cost does not, which one efficiency factor cannot express."""
        overhead = self.launch_overhead_us
        if overhead is None:
            return None
        return step_bytes / (bandwidth_gbs * 1e9) * 1e6 + self.launches * overhead

    def describe(self) -> str:
        return (f"efficiency {self.step_fraction:.2f} of copy bandwidth measured for {self.tokens}-token steps "
                f"({self.composition}) on {self.device}, {self.copy_gbs:.0f} GB/s copy, from {self.source}")


def load_decode_step(path: str | Path, tokens: int = 1, composition: str = "ours") -> MeasuredEfficiency:
    """Read one (token count, composition) of a ``benchmarks/decode_step.py --json`` file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EfficiencyFileError(f"{path}: cannot read a decode_step result ({exc})") from exc
    if composition not in ("ours", "upstream"):
        raise EfficiencyFileError(f"composition must be 'ours' or 'upstream', got {composition!r}")
    rows = {r.get("tokens"): r for r in data.get("results", [])}
    if tokens not in rows:
        raise EfficiencyFileError(f"{path}: no {tokens}-token step (has {sorted(k for k in rows if k)})")
    row = rows[tokens]
    if composition not in row:
        raise EfficiencyFileError(f"{path}: the {tokens}-token step has no {composition!r} composition")
    comp = row[composition]
    try:
        copy_gbs = float(data["copy_gbs"])
        if composition == "ours":
            step_bytes = float(row["plan_bytes_target"]) + float(row["plan_bytes_draft"])
        else:
            step_bytes = float(row["plan_bytes_upstream"])
        class_bytes = comp.get("class_bytes", {})
        classes = {name: ClassEfficiency(float(us), float(class_bytes.get(name, 0.0)))
                   for name, us in comp["classes"].items()}
        return MeasuredEfficiency(source=str(path), device=str(data.get("device", "device not recorded")),
                                  copy_gbs=copy_gbs, tokens=tokens, composition=composition,
                                  step_us=float(comp["us"]), step_bytes=step_bytes,
                                  launches=int(comp.get("launches", 0)), classes=classes)
    except (KeyError, TypeError, ValueError) as exc:
        raise EfficiencyFileError(f"{path}: not a decode_step result ({type(exc).__name__}: {exc})") from exc
