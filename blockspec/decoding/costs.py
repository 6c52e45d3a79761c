"""The target's cost per verify width, T(w): measured once per model and machine, cached on disk.

The adaptive width weighs expected accepted tokens against T(w); measured verify times then
move one shared scale factor (the machine got busier or quieter).
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from blockspec.clock import wall_clock
from blockspec.io import write_text_atomically
from blockspec.models.target import position_ids

#: Weight of the newest measurement in the running averages of T(w) and T_draft.
EMA_WEIGHT = 0.2
#: A cached T(w) older than this is measured again (drivers, BIOS and power settings change
#: what the key cannot see).
COST_CACHE_MAX_AGE_S = 7 * 24 * 3600



@dataclass
class CostModel:
    """Seconds per target forward at each width 1..len(seconds), as calibrated, times a running scale.

    Measured verify times move one scale factor shared by all widths (the machine got busier
    or quieter) rather than each width's own figure: refining only the widths that get chosen
    would let a lucky measurement lock the policy onto one width.
    """

    seconds: list[float]
    scale: float = 1.0

    @property
    def max_width(self) -> int:
        return len(self.seconds)

    def __call__(self, width: int) -> float:
        return self.seconds[min(width, self.max_width) - 1] * self.scale

    def observe(self, width: int, seconds: float) -> None:
        if 1 <= width <= self.max_width and self.seconds[width - 1] > 0:
            self.scale += EMA_WEIGHT * (seconds / self.seconds[width - 1] - self.scale)


def measure_costs(model, max_width: int, *, context_length: int = 128, repeats: int = 3) -> CostModel:
    """T(w) for w = 1..max_width: the median of ``repeats`` forwards of w tokens after a cached context."""
    device = model.device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, context_length), generator=generator).to(device)
    block = torch.randint(0, vocab, (1, max_width), generator=generator).to(device)
    seconds = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
        model(input_ids=block[:, :1], position_ids=position_ids(context_length, 1, device), cache=cache,
              use_cache=True)  # warm-up
        cache.crop(-1)
        for width in range(1, max_width + 1):
            runs = []
            for _ in range(repeats):
                start = wall_clock(device)
                model(input_ids=block[:, :width], position_ids=position_ids(context_length, width, device),
                      cache=cache, use_cache=True, output_hidden_states=True)
                runs.append(wall_clock(device) - start)
                cache.crop(-width)  # back to the context
            seconds.append(statistics.median(runs))
    return CostModel(seconds)


def cost_model_for(model, max_width: int, *, cache_dir: Path | None = None, measure=None) -> CostModel:
    """The target's T(w), measured once per model, dtype, device and thread count, then read from disk.

    ``measure(model, max_width)`` takes the measurement (default ``measure_costs``).
    """
    from blockspec import hub

    directory = Path(cache_dir) if cache_dir is not None else hub.home_dir() / "costs"
    path = directory / f"{_cost_key(model)}.json"
    try:
        saved = json.loads(path.read_text())
        fresh = time.time() - float(saved["measured_at"]) < COST_CACHE_MAX_AGE_S
        if fresh and len(saved["seconds"]) >= max_width:
            return CostModel(list(saved["seconds"][:max_width]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = (measure or measure_costs)(model, max_width)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps({"seconds": costs.seconds, "measured_at": time.time(),
                                                "what": _cost_description(model)}))
    except OSError:  # a read-only cache only costs a new calibration next time
        pass
    return CostModel(list(costs.seconds))


def _cost_description(model) -> dict:
    """What T(w) depends on; a change in any of it (a new machine, a torch upgrade) measures again."""
    import transformers

    config = model.config
    return {"model": str(getattr(config, "_name_or_path", "")), "type": config.model_type,
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size,
            "dtype": str(next(model.parameters()).dtype), "device": str(model.device),
            "hardware": _hardware_name(model.device),
            "threads": torch.get_num_threads() if model.device.type == "cpu" else None,
            "torch": torch.__version__, "transformers": transformers.__version__}


def _hardware_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cost_key(model) -> str:
    return hashlib.sha256(json.dumps(_cost_description(model), sort_keys=True).encode()).hexdigest()[:16]


