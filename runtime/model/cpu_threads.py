"""How many threads torch's CPU kernels use in this process, decided once when the model runner starts.

torch starts one thread per physical core of the machine. In a container whose CPU is limited (cgroup v2
`cpu.max`, what a pod's `resources.limits.cpu` becomes) or pinned (the affinity mask, e.g. the kubelet's
static CPU manager), more threads than the container may run make every parallel region wait for threads the
kernel has throttled or never schedules, and a decode step takes many times longer. So the count is the least
of torch's default, the CPUs this process may run on, and the quota rounded up. `OMP_NUM_THREADS`, when set,
is the user's choice and is left alone.

cgroup v2 `cpu.max` is "<quota> <period>" in microseconds, or "max <period>" for no limit
(https://docs.kernel.org/admin-guide/cgroup-v2.html, "cpu.max").
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def quota_cpus(cpu_max: str) -> float | None:
    """The CPUs a cgroup v2 `cpu.max` line allows (1.5 for "150000 100000"); None for "max" or a line that is
    not in that form."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def thread_count(torch_default: int, affinity: int, quota: float | None) -> int:
    """The least of torch's default, the CPUs in the affinity mask and the quota rounded up; at least 1."""
    limits = [torch_default, affinity]
    if quota is not None:
        limits.append(math.ceil(quota))
    return max(1, min(limits))


def configure() -> int:
    """Set torch's intra-op thread count for this container (unless OMP_NUM_THREADS says it); returns it."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    try:
        quota = quota_cpus(CPU_MAX.read_text())
    except OSError:  # cgroup v1, or not Linux: no quota known
        quota = None
    n = thread_count(torch.get_num_threads(), len(os.sched_getaffinity(0)), quota)
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n
