"""The one output format of every `pdserve bench ... --json`: raw figures plus a `targets` list."""

from __future__ import annotations

import json
import math
import platform
import statistics
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import torch


@dataclass(frozen=True)
class Target:
    name: str
    value: float
    unit: str
    target: float
    comparison: str  # "<=" or ">="

    @property
    def met(self) -> bool:
        return self.value <= self.target if self.comparison == "<=" else self.value >= self.target

    def to_dict(self) -> dict:
        return {**asdict(self), "value": round(self.value, 4), "met": self.met}


def machine() -> dict:
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def finite(x):
    """`x` with every NaN or infinity in it as None (JSON's null): a figure not measured, never a
    number strict JSON parsers refuse (Python writes NaN and Infinity, which are not JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


def dumps(doc: dict, indent: int = 2, default=None) -> str:
    """A bench's document as strict JSON (see `finite`)."""
    return json.dumps(finite(doc), indent=indent, allow_nan=False, default=default)


def emit(figures: dict, targets: list[Target], as_json: bool, lines: list[str]) -> None:
    if as_json:
        print(dumps({**figures, "machine": machine(), "targets": [t.to_dict() for t in targets]}))
        return
    print("\n".join(lines))
    for t in targets:
        print(f"target {t.name}: {t.value:.3f} {t.unit} {t.comparison} {t.target} -> {'met' if t.met else 'NOT met'}")


def median(xs: list[float]) -> float:
    return statistics.median(xs)
