"""The target's cost per verify width, T(w): measured once per model and machine, cached on disk.

The adaptive width weighs expected accepted tokens against T(w); measured verify times then
move one shared scale factor (the machine got busier or quieter).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockspec.clock import wall_clock
from blockspec.decoding.block import VerifyBlock
from blockspec.decoding.forward import SequenceTarget
from blockspec.io import write_text_atomically
from blockspec.machine import hardware_name
from blockspec.models.quantized import quantization_tag

#: Weight of the newest measurement in the running averages of T(w) and T_draft.
EMA_WEIGHT = 0.2
#: A cached T(w) older than this is measured again (drivers, BIOS and power settings change
#: what the key cannot see).
COST_CACHE_MAX_AGE_S = 7 * 24 * 3600
#: Positions already cached when a verify forward is timed.
MEASURED_CONTEXT = 128



@dataclass
class CostModel:
    """Seconds per target forward at each width 1..len(seconds), as calibrated, times a running scale.

    ``seconds`` is one row's forward; ``batches`` holds the forwards of B rows (batch -> seconds per width),
    where a batched path was measured. Between measured batch sizes T is interpolated; without any, B rows
    of width w are taken to cost one row of width B * w (the forward's cost follows the tokens it carries).

    Measured verify times move one scale factor shared by all widths (the machine got busier
    or quieter) rather than each width's own figure: refining only the widths that get chosen
    would let a lucky measurement lock the policy onto one width.
    """

    seconds: list[float]
    scale: float = 1.0
    batches: dict[int, list[float]] = field(default_factory=dict)

    @property
    def max_width(self) -> int:
        return len(self.seconds)

    def __call__(self, width: int, batch: int = 1) -> float:
        return self.unscaled(width, batch) * self.scale

    def unscaled(self, width: int, batch: int = 1) -> float:
        """T(batch, width) as calibrated."""
        width = min(width, self.max_width)
        if batch <= 1:
            return self.seconds[width - 1]
        if not self.batches:
            return _along(self.seconds, batch * width)
        table = {1: self.seconds, **self.batches}
        sizes = sorted(table)
        below = max(b for b in sizes if b <= batch)
        above = next((b for b in sizes if b >= batch), None)
        if above is None:  # past the widest batch measured: extrapolate from the last two
            below, above = sizes[-2], sizes[-1]
        if above == below:
            return table[below][width - 1]
        low, high = table[below][width - 1], table[above][width - 1]
        return low + (high - low) * (batch - below) / (above - below)

    def observe(self, width: int, seconds: float, batch: int = 1) -> None:
        expected = self.unscaled(width, batch)
        if 1 <= width <= self.max_width and expected > 0:
            self.scale += EMA_WEIGHT * (seconds / expected - self.scale)


def _along(seconds: list[float], width: int) -> float:
    """T(width) from one row's table, extrapolated linearly past its widest."""
    if width <= len(seconds):
        return seconds[width - 1]
    slope = seconds[-1] - seconds[-2] if len(seconds) > 1 else seconds[-1]
    return seconds[-1] + max(slope, 0.0) * (width - len(seconds))


def measure_costs(model, max_width: int, *, new_target=None, context_length: int = MEASURED_CONTEXT, repeats: int = 3,
                  batch_sizes: tuple[int, ...] = (1,)) -> CostModel:
    """T(w) for w = 1..max_width: the median of ``repeats`` verify forwards of w tokens after a cached context,
    for one row and for each of ``batch_sizes`` rows (those at a grid of widths, interpolated between).

    ``new_target()`` gives the ``VerifyTarget`` to time (default: the dynamic-cache forward with
    hidden states out, as a drafter reading features runs it); for batches above 1, one that takes
    a prefill per row.
    """
    device = model.device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, context_length), generator=generator).to(device)
    block = torch.randint(0, vocab, (max_width,), generator=generator).tolist()
    if new_target is None:
        new_target = lambda: SequenceTarget(model, [model.config.num_hidden_layers - 1])  # noqa: E731
    tables = {}
    with torch.inference_mode():
        for batch in sorted({1, *batch_sizes}):
            target = new_target()
            for _ in range(batch):
                target.prefill(context)
            _time_verify(target, block[:1], context_length, batch, device)  # warm-up
            widths = range(1, max_width + 1) if batch == 1 else width_grid(max_width)
            measured = {width: statistics.median(_time_verify(target, block[:width], context_length, batch, device)
                                                 for _ in range(repeats))
                        for width in widths}
            tables[batch] = _interpolated(measured, max_width)
    return CostModel(tables.pop(1), batches=tables)


def width_grid(max_width: int) -> list[int]:
    """The widths a batch's T(w) is measured at: each side of every bucket edge (1, 2, 4, 8, ...), so a
    compiled path's steps are caught and an eager path's slope is followed."""
    widths = {1, max_width}
    edge = 2
    while edge <= max_width:
        widths.update((edge, min(edge + 1, max_width)))
        edge *= 2
    return sorted(widths)


def _interpolated(measured: dict[int, float], max_width: int) -> list[float]:
    """Seconds at every width 1..max_width, linear between the measured ones."""
    known = sorted(measured)
    seconds = []
    for width in range(1, max_width + 1):
        low = max(w for w in known if w <= width)
        high = min(w for w in known if w >= width)
        share = 0.0 if high == low else (width - low) / (high - low)
        seconds.append(measured[low] + share * (measured[high] - measured[low]))
    return seconds


def _time_verify(target, tokens: list[int], start: int, rows: int, device) -> float:
    """Seconds of one verify forward of ``rows`` blocks; the cache is then rolled back to the context."""
    began = wall_clock(device)
    target.verify([VerifyBlock(list(tokens), start) for _ in range(rows)])
    seconds = wall_clock(device) - began
    target.keep([[] for _ in range(rows)])
    return seconds


def cost_model_for(model, max_width: int, *, cache_dir: Path | None = None, measure=None,
                   path: str = "dynamic", batch_sizes: tuple[int, ...] = (1,)) -> CostModel:
    """The target's T(w), measured once per model, dtype, device, thread count and forward path
    (``path``: "dynamic", or the fast path's), then read from disk.

    ``measure(model, max_width)`` takes the measurement (default ``measure_costs``); ``batch_sizes``: the row
    counts a batched path needs measured (a cached figure without them is measured again).
    """
    from blockspec import hub

    directory = Path(cache_dir) if cache_dir is not None else hub.home_dir() / "costs"
    file = directory / f"{_cost_key(model, path)}.json"
    try:
        saved = json.loads(file.read_text())
        fresh = time.time() - float(saved["measured_at"]) < COST_CACHE_MAX_AGE_S
        batches = {int(b): seconds for b, seconds in saved.get("batches", {}).items()}
        if fresh and len(saved["seconds"]) >= max_width and set(batch_sizes) <= {1, *batches} and \
                all(len(seconds) >= max_width for seconds in batches.values()):
            return CostModel(list(saved["seconds"][:max_width]),
                             batches={b: seconds[:max_width] for b, seconds in batches.items()})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = (measure or measure_costs)(model, max_width)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_text_atomically(file, json.dumps({"seconds": costs.seconds, "batches": costs.batches,
                                                "measured_at": time.time(),
                                                "what": _cost_description(model, path)}))
    except OSError:  # a read-only cache only costs a new calibration next time
        pass
    return CostModel(list(costs.seconds), batches=dict(costs.batches))


def batch_cost_model(model, widest: int, max_batch_size: int, new_target, path: str) -> CostModel:
    """T(B, w) through a batch target (``new_target()``: an empty one) for B up to ``max_batch_size``."""
    batches = batch_grid(max_batch_size)

    def measure(model, max_width):
        return measure_costs(model, max_width, new_target=new_target, batch_sizes=batches)

    return cost_model_for(model, widest, measure=measure, path=path, batch_sizes=batches)


def batch_grid(max_batch_size: int) -> tuple[int, ...]:
    """The row counts T(B, w) is measured at: powers of two, and the largest batch."""
    sizes, size = {max_batch_size}, 1
    while size < max_batch_size:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


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
            "quantize": quantization_tag(model)}


def _cost_key(model, path: str) -> str:
    return hashlib.sha256(json.dumps(_cost_description(model, path), sort_keys=True).encode()).hexdigest()[:16]


