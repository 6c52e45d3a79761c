"""Adaptive verify width: each step verifies the prefix of the draft that pays best.

On a CPU the target's forward grows with its width, so verifying all 15 drafts of a block
wastes time when the drafter is unsure, and a small fixed width wastes acceptance when it
is sure. Each step, for every width w (the last token + w-1 drafts):

    expected tokens(w) = 1 + sum_{j<w} prod_{k<=j} c_k,    rate(w) = tokens(w) / (T_draft + T(w))

where c_k is the drafter's confidence in draft k, calibrated online against the run's own
accept / reject history (isotonic over confidence bins), T(w) the target's forward time at
width w (calibrated once per model and device, cached on disk, then scaled by how the
measured verify times compare with it) and T_draft the measured drafting time. The width with the highest
rate is verified. The verifier sees an ordinary (shorter) proposal, so output stays lossless.
In a batch of B rows, one width serves them all: the one with the most expected tokens over the rows
per second of B drafts plus T(B, w), the target's forward for B rows of w tokens (also measured).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from blockspec.decoding.block import chain_parents
from blockspec.decoding.costs import EMA_WEIGHT, CostModel, cost_model_for
from blockspec.errors import BlockspecError

#: GenerationConfig.block_size value that turns adaptive width on.
AUTO = "auto"
#: While drafting pays less than plain decoding, draft only every this many steps (to keep
#: measuring whether it has started to pay); each probe that still does not pay doubles the gap,
#: up to PROBE_AT_MOST, so that text a drafter cannot predict costs next to nothing.
PROBE_EVERY = 8
PROBE_AT_MOST = 64


# ---------------------------------------------------------------------------
# Calibration of confidence against acceptance
# ---------------------------------------------------------------------------

@dataclass
class AcceptanceCalibrator:
    """P(draft accepted | its confidence, the drafts before it accepted), learned online.

    Confidences fall into ``bins`` equal bins over [0, 1]; each bin counts the drafts the
    verifier reached and accepted. A bin's estimate is its acceptance rate shrunk toward the
    raw confidence by ``prior_strength`` pseudo-observations (so it starts as "trust the
    drafter" and moves to the data), made non-decreasing in confidence by pool-adjacent-
    violators (isotonic regression weighted by the counts).
    """

    bins: int = 20
    prior_strength: float = 4.0
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.tried:
            self.tried = [0.0] * self.bins
            self.accepted = [0.0] * self.bins
        self._table: list[float] | None = None

    def observe_candidates(self, confidences, accepted_index: int | None) -> None:
        """One tree level: candidate children tried together, at most one of them accepted."""
        for i, confidence in enumerate(confidences):
            b = self._bin(float(confidence))
            self.tried[b] += 1
            self.accepted[b] += i == accepted_index
        self._table = None

    def __call__(self, confidence: float) -> float:
        if self._table is None:
            self._table = self._isotonic()
        return self._table[self._bin(confidence)]

    def _bin(self, confidence: float) -> int:
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def _isotonic(self) -> list[float]:
        centres = [(b + 0.5) / self.bins for b in range(self.bins)]
        weights = [t + self.prior_strength for t in self.tried]
        rates = [(a + self.prior_strength * c) / w for a, c, w in zip(self.accepted, centres, weights)]
        blocks: list[list[float]] = []  # [value, weight, count] per pooled block
        for rate, weight in zip(rates, weights):
            blocks.append([rate, weight, 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                v2, w2, n2 = blocks.pop()
                v1, w1, n1 = blocks.pop()
                blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
        return [value for value, _, count in blocks for _ in range(count)]

    def curve(self) -> list[dict]:
        """Per bin: the confidence range, how many drafts were tried, observed and predicted acceptance."""
        return [{"low": b / self.bins, "high": (b + 1) / self.bins, "tried": self.tried[b],
                 "observed": self.accepted[b] / self.tried[b] if self.tried[b] else None,
                 "predicted": self((b + 0.5) / self.bins)} for b in range(self.bins)]


# ---------------------------------------------------------------------------
# The policy
# ---------------------------------------------------------------------------

class AdaptiveWidth:
    """Chooses each step's verify width from the drafts' confidences, and learns from the verdicts.

    One policy may serve a batch: its rows' drafts are cut to one width W, the one whose expected
    tokens over all rows per second of T(B, W) (the target's forward for B rows of width W) is best,
    so a batch drafts less as it grows.
    """

    def __init__(self, costs: CostModel, calibrator: AcceptanceCalibrator | None = None):
        self.costs = costs
        self.calibrator = calibrator or AcceptanceCalibrator()
        #: Running seconds one row's drafting takes.
        self.draft_seconds: float | None = None
        #: Running speed of the steps that drafted over plain one-token steps of the same batch, per batch size
        #: (rounded down to a power of two): drafting that pays for one row may not for sixteen.
        self.speedups: dict[int, float] = {}
        self._skipped = 0
        self._probe_gap = PROBE_EVERY
        self._probing = False

    def should_draft(self, batch: int = 1) -> bool:
        """Whether to draft this step of ``batch`` rows: no when drafting has paid less than one-token steps at
        this batch size, but every ``PROBE_EVERY``-th step anyway, a gap that doubles with each probe that
        still does not pay. (Skipping only makes the step plain decoding.) Asked once a step, for every row
        it serves."""
        if not self._drafting_lags(batch):
            return True
        self._skipped += 1
        if self._skipped >= self._probe_gap:
            self._skipped = 0
            self._probing = True
            return True
        return False

    def _drafting_lags(self, batch: int) -> bool:
        speedup = self.speedups.get(batch_bucket(batch))
        return speedup is not None and speedup < 1.0

    def expected_tokens(self, confidences, parents: list[int] | None = None) -> list[float]:
        """Expected tokens of verifying the first n drafts (listed parents first, best first; ``parents``: each
        one's parent among them, -1 the root, None a chain), for widths w = n + 1 = 1..len(confidences)+1. A
        draft is accepted only if its whole path is, and siblings exclude each other, so the expected accepted
        length is the sum of the drafts' path reach."""
        parents = chain_parents(len(confidences)) if parents is None else parents
        reach, expected = [], [1.0]
        for confidence, parent in zip(confidences, parents):
            reach.append(self.calibrator(float(confidence)) * (reach[parent] if parent >= 0 else 1.0))
            expected.append(expected[-1] + reach[-1])
        return expected

    def choose_width(self, expected: list[list[float]], batch: int | None = None, floor: int = 1) -> int:
        """The width W that pays best for rows with these expected-token curves (``expected[r][w - 1]``), each
        verifying up to W: the most expected tokens per second of drafting plus T(batch, max(W, floor)).
        ``batch``: the rows the forward carries (default: these); ``floor``: the widest block of rows the
        policy does not choose for."""
        batch = batch or len(expected)
        drafting = (self.draft_seconds or 0.0) * len(expected)
        best, best_rate = 1, -1.0
        for width in range(1, max(len(curve) for curve in expected) + 1):
            tokens = sum(curve[min(width, len(curve)) - 1] for curve in expected)
            rate = tokens / (drafting + self.costs(max(width, floor), batch))
            if rate > best_rate:
                best, best_rate = width, rate
        return best

    def choose(self, confidences, parents: list[int] | None = None) -> int:
        """One sequence's verify width: the root and its first ``width - 1`` drafts."""
        return self.choose_width([self.expected_tokens(confidences, parents)])

    def observe(self, confidences, parents: list[int] | None, path: list[int]) -> None:
        """One verdict: the drafts on ``path`` accepted, in order (``parents``: as in ``expected_tokens``)."""
        parents = chain_parents(len(confidences)) if parents is None else parents
        for candidates, accepted in walked_levels(parents, path, confidences):
            if candidates:
                self.calibrator.observe_candidates(candidates, accepted)

    def observe_step(self, *, rows: int, batch: int, width: int, tokens: int, draft_seconds: float,
                     verify_seconds: float) -> None:
        """One step of ``rows`` drafting rows (of ``batch`` in the forward, ``width`` wide) that produced
        ``tokens`` in all: the times move the cost model, and the speed over plain steps decides drafting."""
        self.costs.observe(width, verify_seconds, batch)
        per_row = draft_seconds / rows
        self.draft_seconds = per_row if self.draft_seconds is None else \
            self.draft_seconds + EMA_WEIGHT * (per_row - self.draft_seconds)
        seconds = draft_seconds + verify_seconds
        if seconds <= 0:
            return
        speedup = (tokens / seconds) / (batch / self.costs(1, batch))
        bucket = batch_bucket(batch)
        known = self.speedups.get(bucket)
        self.speedups[bucket] = speedup if known is None else known + EMA_WEIGHT * (speedup - known)
        if not self._drafting_lags(batch):
            self._probe_gap = PROBE_EVERY
        elif self._probing:
            self._probe_gap = min(2 * self._probe_gap, PROBE_AT_MOST)
        self._probing = False


def batch_bucket(batch: int) -> int:
    """The batch sizes whose drafting speed is tracked together: the largest power of two <= ``batch``."""
    return 1 << (max(batch, 1).bit_length() - 1)


def walked_levels(parents: list[int], path: list[int], confidences) -> list[tuple[list[float], int | None]]:
    """For each draft the verifier stood on (the root, then the path): its children's confidences and the
    index among them of the one accepted (None at the last)."""
    children = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    levels = []
    for here, following in zip([-1] + path, path + [None]):
        below = children.get(here, [])
        levels.append(([confidences[c] for c in below], below.index(following) if following is not None else None))
    return levels


class WidthPolicies:
    """The adaptive-width policies of one driver (a stream of prompts, a server, a benchmark method).

    One policy per kind of step (chain, or tree), widest width and forward path, so its
    calibration carries over from prompt to prompt. ``measure(model, widest)`` gives the
    target's T(w) (default: measured once per model, machine and forward path, cached on disk).
    """

    def __init__(self, measure: Callable[..., CostModel] | None = None):
        self.measure = measure
        self.policies: dict[tuple[str, int, str], AdaptiveWidth] = {}

    def get(self, model, widest: int, *, tree: bool, path: str = "dynamic",
            measure: Callable[..., CostModel] | None = None) -> AdaptiveWidth:
        """``path``: the name of the forward path the target runs through; ``measure(model, widest)``: its T(w)
        (a batch engine's: T(B, w) for its rows), by default the eager forward's."""
        key = ("tree" if tree else "chain", widest, path)
        if key not in self.policies:
            measure = self.measure or measure or cost_model_for
            self.policies[key] = AdaptiveWidth(measure(model, widest))
        return self.policies[key]

    def all(self) -> list[AdaptiveWidth]:
        return list(self.policies.values())


def check_block_size(value) -> None:
    if value is None or value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise BlockspecError(f"block_size must be a whole number >= 1 or 'auto', got {value!r}")
    if value < 1:
        raise BlockspecError(f"block_size must be >= 1 or 'auto', got {value}")
