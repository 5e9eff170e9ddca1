"""What the benchmarks say of the machine they ran on, and read of its processes (imported as a neighbour:
the script's folder is on sys.path when it runs; tests/support.py loads it too)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (its results depend on it: AVX2 or AVX512-BF16 and AMX)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_seconds(pid: int) -> float:
    """CPU time a process used so far (user + system: /proc/PID/stat's utime and stime); 0 where there is no
    /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
