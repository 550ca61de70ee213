"""Longest common token prefix of two id arrays: the lookup both cache tiers are built on."""

from __future__ import annotations

import numpy as np

# Prefix comparison looks at this many tokens first and doubles: most entries diverge early, so
# the cost per entry tracks the match length rather than the prompt length.
_FIRST_WINDOW = 256


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    start, window = 0, _FIRST_WINDOW
    while start < n:
        end = min(n, start + window)
        diff = np.flatnonzero(a[start:end] != b[start:end])
        if diff.size:
            return start + int(diff[0])
        start, window = end, window * 2
    return n
