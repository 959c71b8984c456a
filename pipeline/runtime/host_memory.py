"""Freed host memory stays in the process, so a CPU step does not fault in fresh pages for its
activations every time.

glibc serves an allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and returns
it to the kernel when freed, so every large activation of a CPU step starts as untouched pages: a
1024-token prefill of mistral3 (an MLP activation is [1024, 32768] float32, 128 MiB) faulted in
about 1.3 GB per call. On a virtual machine a fault can cost tens of microseconds, when the host
has taken the page back: an elementwise op over such an activation then took many times its time
on pages already touched, and the whole prefill measurably longer. `mallopt(M_MMAP_MAX, 0)` serves large allocations from the heap and
a high `M_TRIM_THRESHOLD` keeps the freed heap, so the next step's activations land on touched pages.

Process-wide until given back: memory freed meanwhile is kept for the process's later allocations
(up to 2 GiB free at the top of the heap; more than that goes back to the system). So it is set
where a run starts to generate (weights, allocated before, keep their own mappings and are given
back when freed), and `runtime.retain_host_memory=false` leaves glibc's default. A sweep runs its
jobs in one process: a job's weights allocated while the setting held would come from the heap,
and freed there (not at its top) they would stay in the process, so a later job's memory check
found too little free memory to load its model. `give_back_freed_memory`, called
between a sweep's jobs (pipeline/__main__.py), returns glibc to its defaults and the heap's free
pages to the system.
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
# mallopt takes an int: the largest finite trim threshold is 2 GiB (-1 is none: nothing goes back,
# keep_all_freed_memory), above a step's activations (1.3 GB in the prefill above); a freed top of
# the heap larger than that (a model's weights) still goes back
TRIM_THRESHOLD = 2**31 - 1
# glibc's defaults (malloc/malloc.c: DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD). Once either was set,
# glibc's mmap threshold stops adapting and stays at 128 KiB: after the give-back every block above
# it is mapped fresh and unmapped when freed, as in a new process before its threshold grows.
DEFAULT_MMAP_MAX = 65536
DEFAULT_TRIM_THRESHOLD = 128 * 1024

_retained = False


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def retain_freed_memory() -> str:
    """Keep freed host memory in this process (until `give_back_freed_memory`). Returns what was
    done, one line for the log: glibc's allocator retuned, or why not (another C library)."""
    return _retain(
        TRIM_THRESHOLD, "host memory: large allocations from the heap, freed memory kept for the next step"
    )


def keep_all_freed_memory() -> str:
    """As `retain_freed_memory`, with no limit on the free top of the heap kept (glibc reads a trim
    threshold of -1 as none): the load bench touches a model's bytes, frees them, and loads on them."""
    return _retain(-1, "host memory: large allocations from the heap, all freed memory kept")


def _retain(trim_threshold: int, message: str) -> str:
    global _retained
    libc = _glibc()
    if libc is None:
        return "host memory: glibc's mallopt not found; freed memory goes back to the system"
    # each returns 1 on success
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)):
        return "host memory: mallopt refused; freed memory goes back to the system"
    if not _retained:
        log.info(message)
    _retained = True
    return message


def give_back_freed_memory() -> bool:
    """glibc's defaults again, and every free page of the heap returned to the system (malloc_trim
    also releases free chunks below the heap's top). Returns whether memory had been retained."""
    global _retained
    libc = _glibc()
    if not _retained or libc is None:
        return False
    libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
    libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
    libc.malloc_trim(0)
    _retained = False
    return True
