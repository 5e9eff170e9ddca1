"""The CPU thread count: the least of torch's default, the affinity mask and the cgroup v2 quota."""

import pytest

from neuronfleet.runtime.model.cpu_threads import quota_cpus, thread_count


@pytest.mark.parametrize(
    ("line", "cpus"),
    [
        ("max 100000\n", None),  # no limit
        ("150000 100000\n", 1.5),  # resources.limits.cpu: 1500m
        ("50000 100000", 0.5),
        ("200000 50000", 4.0),
        ("", None),
        ("garbage", None),
        ("x 100000", None),
        ("0 100000", None),
    ],
)
def test_cgroup_cpu_max_lines_read_as_cpus(line, cpus):
    assert quota_cpus(line) == cpus


@pytest.mark.parametrize(
    ("torch_default", "affinity", "quota", "threads"),
    [
        (8, 8, None, 8),  # a whole node: torch's own choice
        (8, 8, 1.5, 2),  # a 1500m limit: two threads, the second one busy half the time
        (8, 8, 0.5, 1),  # under one CPU: still one thread
        (8, 2, None, 2),  # pinned to two CPUs (static CPU manager)
        (2, 16, 4.0, 2),  # torch's default (physical cores) below both
    ],
)
def test_threads_never_exceed_what_the_container_may_run(torch_default, affinity, quota, threads):
    assert thread_count(torch_default, affinity, quota) == threads
