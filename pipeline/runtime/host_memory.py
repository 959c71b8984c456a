"""Freed host memory stays in the process, so a CPU step does not fault in fresh pages for its
activations every time.

glibc serves an allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and returns
it to the kernel when freed, so every large activation of a CPU step starts as untouched pages: a
1024-token prefill of mistral3 (an MLP activation is [1024, 32768] float32, 128 MiB) faulted in
about 1.3 GB per call. On this virtual machine a fault can cost tens of microseconds, when the host
has taken the page back: `silu` over that activation took 1.07 s in the prefill against 13 ms on
pages already touched, and the prefill 8.5-8.9 s against 7.3-7.5 s with its memory kept
(2026-12-03, AMX Xeon host). `mallopt(M_MMAP_MAX, 0)` serves large allocations from the heap and
a high `M_TRIM_THRESHOLD` keeps the freed heap, so the next step's activations land on touched pages.

Process-wide and one-way: memory freed afterwards is kept for the process's later allocations
(up to 2 GiB free at the top of the heap; more than that goes back to the system). So it is set
where a run starts to generate (weights, allocated before, keep their own mappings and are given
back when freed), and `runtime.retain_host_memory=false` leaves glibc's default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# mallopt takes an int: the largest trim threshold is 2 GiB, above a step's activations (1.3 GB in
# the prefill above); a freed top of the heap larger than that (a model's weights) still goes back
TRIM_THRESHOLD = 2**31 - 1


@functools.cache
def retain_freed_memory() -> str:
    """Keep freed host memory in this process (once per process). Returns what was done, one line
    for the log: glibc's allocator retuned, or why not (another C library)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"host memory: glibc's mallopt not found ({name}); freed memory goes back to the system"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # each returns 1 on success
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "host memory: mallopt refused; freed memory goes back to the system"
    message = "host memory: large allocations from the heap, freed memory kept for the next step"
    log.info(message)
    return message
