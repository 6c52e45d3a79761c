"""Wall-clock time that includes the device's queued work."""

from __future__ import annotations

import time

import torch


def wall_clock(device) -> float:
    """perf_counter after the device has finished its queued work (so timings include it)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()
