"""C sources built on first use with the machine's compiler, for this CPU, and loaded with ctypes
(or imported, as an extension module).

Each library is built into a cache directory keyed by its sources, the flags and the CPU, so
every process of one machine reuses one build. Concurrent first builds are safe: each compiles
to its own temporary file and renames it into place.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path


class NativeUnavailable(RuntimeError):
    """The library cannot be built or loaded here; the message says why and what to install."""


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_KERNEL_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve" / "kernels"
    return Path(root)


def cpuinfo_lines(*fields: str) -> list[str]:
    """The lines of /proc/cpuinfo that start with any of `fields` (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return [line for line in f if line.startswith(fields)]
    except OSError:
        return []


def cpu_vendor() -> str:
    """The first CPU's vendor_id ("GenuineIntel", "AuthenticAMD"; "" where it cannot be read)."""
    lines = cpuinfo_lines("vendor_id")
    return lines[0].split(":", 1)[1].strip() if lines else ""


def _cpu_key() -> str:
    return "".join(cpuinfo_lines("model name", "flags")[:2] or [platform.processor()])


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise NativeUnavailable("no C compiler found (set CC, or install gcc: apt-get install gcc)")


def shared_object(name: str, sources: list[Path], flags: list[str], link_flags: list[str]) -> Path:
    """The path of the shared object `name` built from `sources` (built now if this machine has
    none yet), not loaded: for LD_PRELOAD, say."""
    cc = _compiler()
    key = hashlib.sha256(b"".join(src.read_bytes() for src in sources) + " ".join([cc, *flags, *link_flags]).encode()
                         + _cpu_key().encode()).hexdigest()
    target = cache_dir() / f"{name}-{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        objects = [f"{tmp}.{src.stem}.o" for src in sources]
        try:
            steps = [[cc, *flags, "-c", str(src), "-o", obj] for src, obj in zip(sources, objects, strict=True)]
            for cmd in [*steps, [cc, *objects, "-o", tmp, *link_flags]]:
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise NativeUnavailable(f"building {name} with {cc} failed: {done.stderr.strip()[-600:]}")
            os.replace(tmp, target)
        finally:
            for leftover in (tmp, *objects):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    return target


def build(name: str, sources: list[Path], flags: list[str], link_flags: list[str]) -> ctypes.CDLL:
    """The library `name` built from `sources`, loaded with ctypes."""
    return ctypes.CDLL(str(shared_object(name, sources, flags, link_flags)))
