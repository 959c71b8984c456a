"""What /proc/cpuinfo says of this CPU: the kernels' build and choices depend on it."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpuinfo_field(name: str) -> str:
    """The value of the first /proc/cpuinfo line named `name` ('model name', 'flags'), '' where
    there is none or the file cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""
