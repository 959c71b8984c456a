"""Kernel categories from the ordered regex map in `profile.kernel_categories` (first match wins;
`other` when none matches). Patterns match GPU kernel names and, on CPU, ATen/torch.library op
names, case-insensitively."""

from __future__ import annotations

import re
from collections.abc import Mapping

OTHER = "other"


class Categorizer:
    def __init__(self, patterns: Mapping[str, str]):
        self.patterns = [(name, re.compile(regex, re.IGNORECASE)) for name, regex in patterns.items()]
        self.names = [name for name, _ in self.patterns] + [OTHER]
        self._cache: dict[str, str] = {}

    def __call__(self, kernel: str) -> str:
        if kernel not in self._cache:
            self._cache[kernel] = next((name for name, rx in self.patterns if rx.search(kernel)), OTHER)
        return self._cache[kernel]
