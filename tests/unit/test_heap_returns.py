"""runtime/model/heap_returns.py: while a model loads, the large blocks it frees go back to the system at
once, also after glibc's own rule has raised its mmap threshold (which it does when a large block is
freed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from neuronfleet.runtime.model import heap_returns

# In a fresh process: raise glibc's threshold the way loading does (free one 16 MiB block), then hold twenty
# 4 MiB temporaries between small kept blocks, as file buffers lie between kept weights, and free them.
# What is still resident of them, in MiB, inside `loading()` (on) or without it (off).
PROGRAM = """
import contextlib, sys
import torch
from neuronfleet.runtime.model import heap_returns

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

first = torch.ones(16 << 20, dtype=torch.uint8)
del first
context = heap_returns.loading() if sys.argv[1] == "on" else contextlib.nullcontext()
with context:
    before = rss_mib()
    temporaries, kept = [], []
    for _ in range(20):
        temporaries.append(torch.ones(4 << 20, dtype=torch.uint8))
        kept.append(torch.ones(64 << 10, dtype=torch.uint8))
    del temporaries
    print(rss_mib() - before)
"""


def resident_after_freeing(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(heap_returns.glibc() is None, reason="glibc's malloc only")
def test_what_loading_frees_goes_back_to_the_system_at_once():
    kept_mib = 20 * 64 / 1024
    assert resident_after_freeing("on") < kept_mib + 8  # the kept blocks, and a little of the allocator's own
    # The program does show the problem: without it glibc keeps the freed temporaries (80 MiB of them).
    assert resident_after_freeing("off") > 40
