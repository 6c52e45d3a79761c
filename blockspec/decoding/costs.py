"""The target's cost per verify width, T(w): measured once per model and machine, cached on disk.

The adaptive width weighs expected accepted tokens against T(w); measured verify times then
move one shared scale factor (the machine got busier or quieter).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.clock import wall_clock
from blockspec.decoding.forward import SequenceTarget, VerifyBlock
from blockspec.io import write_text_atomically
from blockspec.machine import hardware_name
from blockspec.models.quantized import quantization_of

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


def measure_costs(model, max_width: int, *, new_target=None, context_length: int = 128,
                  repeats: int = 3) -> CostModel:
    """T(w) for w = 1..max_width: the median of ``repeats`` verify forwards of w tokens after a cached context.

    ``new_target()`` gives the ``VerifyTarget`` to time (default: the dynamic-cache forward with
    hidden states out, as a drafter reading features runs it).
    """
    device = model.device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, context_length), generator=generator).to(device)
    block = torch.randint(0, vocab, (max_width,), generator=generator).tolist()
    if new_target is None:
        new_target = lambda: SequenceTarget(model, [model.config.num_hidden_layers - 1])  # noqa: E731
    seconds = []
    with torch.inference_mode():
        target = new_target()
        target.prefill(context)
        _time_verify(target, block[:1], context_length, device)  # warm-up
        for width in range(1, max_width + 1):
            runs = [_time_verify(target, block[:width], context_length, device) for _ in range(repeats)]
            seconds.append(statistics.median(runs))
    return CostModel(seconds)


def _time_verify(target, tokens: list[int], start: int, device) -> float:
    """Seconds of one verify forward; the cache is then rolled back to the context."""
    began = wall_clock(device)
    target.verify([VerifyBlock(list(tokens), start)])
    seconds = wall_clock(device) - began
    target.keep([[]])
    return seconds


def cost_model_for(model, max_width: int, *, cache_dir: Path | None = None, measure=None,
                   path: str = "dynamic") -> CostModel:
    """The target's T(w), measured once per model, dtype, device, thread count and forward path
    (``path``: "dynamic", or the fast path's), then read from disk.

    ``measure(model, max_width)`` takes the measurement (default ``measure_costs``).
    """
    from blockspec import hub

    directory = Path(cache_dir) if cache_dir is not None else hub.home_dir() / "costs"
    file = directory / f"{_cost_key(model, path)}.json"
    try:
        saved = json.loads(file.read_text())
        fresh = time.time() - float(saved["measured_at"]) < COST_CACHE_MAX_AGE_S
        if fresh and len(saved["seconds"]) >= max_width:
            return CostModel(list(saved["seconds"][:max_width]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = (measure or measure_costs)(model, max_width)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_text_atomically(file, json.dumps({"seconds": costs.seconds, "measured_at": time.time(),
                                                "what": _cost_description(model, path)}))
    except OSError:  # a read-only cache only costs a new calibration next time
        pass
    return CostModel(list(costs.seconds))


def _cost_description(model, path: str) -> dict:
    """What T(w) depends on; a change in any of it (a new machine, a torch upgrade) measures again."""
    import transformers

    config = model.config
    return {"model": str(getattr(config, "_name_or_path", "")), "type": config.model_type,
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size,
            "dtype": str(next(model.parameters()).dtype), "device": str(model.device),
            "hardware": hardware_name(model.device),
            "threads": torch.get_num_threads() if model.device.type == "cpu" else None,
            "torch": torch.__version__, "transformers": transformers.__version__, "path": path,
            "quantize": quantization_of(model)}


def _cost_key(model, path: str) -> str:
    return hashlib.sha256(json.dumps(_cost_description(model, path), sort_keys=True).encode()).hexdigest()[:16]


