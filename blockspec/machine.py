"""What a measurement depends on beyond the model: the hardware, the thread count, the libraries."""

from __future__ import annotations

import functools
import platform

import torch


def hardware_name(device) -> str:
    """The GPU's name, or the CPU's model name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_name()


@functools.cache
def _cpu_name() -> str:  # read once: every cached measurement's key asks for it
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(device) -> dict:
    """The facts a timing measured on ``device`` holds for: a change in any of them measures again."""
    device = torch.device(device)
    return {"hardware": hardware_name(device), "device": device.type,
            "threads": torch.get_num_threads() if device.type == "cpu" else None, "torch": torch.__version__}
