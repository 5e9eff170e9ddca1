"""What the benchmarks say of the machine they ran on (imported as a neighbour: the script's folder is on
sys.path when it runs)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (its results depend on it: AVX2 or AVX512-BF16 and AMX)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()
