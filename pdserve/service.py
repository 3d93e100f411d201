"""What every service process does around its own logic: flags, logs, ready file, signals."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from pdserve import config as config_mod
from pdserve import logs, telemetry

T = TypeVar("T")


def parse_config(cls: type[T], prog: str, argv: list[str] | None = None) -> T:
    parser = argparse.ArgumentParser(prog=prog)
    config_mod.add_flags(parser, cls)
    return config_mod.load(cls, parser.parse_args(argv))


def write_port_file(path: str, port: int) -> None:
    """Atomically publish the bound port (readers poll for the file)."""
    if not path:
        return
    tmp = Path(path + ".tmp")
    tmp.write_text(str(port))
    os.replace(tmp, path)


def run(name: str, main: Callable[[], Awaitable[None]]) -> None:
    logs.configure(name)
    telemetry.setup_tracing(name)  # before any channel exists: interceptors are fixed at creation
    try:
        asyncio.run(main())
    finally:
        telemetry.shutdown_tracing()
