"""Which torch device an engine runs on: the one place a device name becomes a `torch.device`."""

from __future__ import annotations

import re

import torch

DEVICE_CHOICES = "auto | cpu | cuda | cuda:N"
_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(name: str) -> None:
    """ValueError unless `name` is one of DEVICE_CHOICES (config validation: no torch query)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"device must be {DEVICE_CHOICES}, got {name!r}")


def resolve_device(name: str) -> torch.device:
    """`auto`: the first CUDA device when torch sees one, else the CPU. A CUDA device that torch
    cannot see is an error here, at start, never a silent CPU run."""
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: torch sees no CUDA device here (torch {torch.__version__})")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    return device


def describe(device: torch.device) -> str:
    """The device as a worker reports it: `cpu`, or `cuda:0 (NVIDIA H200)`."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
