"""How this process's C heap (glibc malloc) behaves while the model loads, and after.

glibc serves an allocation from its heap unless it is at least the mmap threshold, which starts at 128 KiB
and then rises to the size of each larger block freed, up to 32 MiB, with the trim threshold at twice that
(glibc's mallopt(3): M_MMAP_THRESHOLD, M_TRIM_THRESHOLD). Loading a model frees thousands of temporaries of a
few MiB (file buffers, the int4 repacking) between blocks it keeps, so afterwards the heap is mostly free
chunks it never returns (more than the kept tensors themselves, for SmolLM2-135M int4).

So while the model loads the threshold is fixed at 128 KiB (every larger block is its own mapping, unmapped
when freed: resident memory follows what is alive); afterwards it is fixed where glibc's own rule ends up,
32 MiB with the trim threshold at 64 MiB, because a decode step's activations of a few hundred KiB would
otherwise each cost a fresh mapping, its pages zeroed on first touch (a decode step would take longer). What
it saves is in docs/benchmarks.md.

Where the C library is not glibc (musl, macOS) nothing is changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
LOADING_MMAP_THRESHOLD = 128 * 1024
SERVING_MMAP_THRESHOLD = 32 * 1024 * 1024
SERVING_TRIM_THRESHOLD = 2 * SERVING_MMAP_THRESHOLD


def glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has a mallopt that does nothing)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Large blocks go back to the system at once inside; serving settings and a trimmed heap after."""
    libc = glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, SERVING_MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, SERVING_TRIM_THRESHOLD)
            libc.malloc_trim(0)
