"""The fast path: the target's forward over a static KV cache, on a CPU with each linear layer on the
kernel measured fastest for it (``blockspec.models.packed``), optionally compiled once per verify width bucket.

The forward runs the model's own decoder layers (Hugging Face modules) in a loop of ours, which
writes keys/values at explicit columns of the ``StaticKVCache`` and returns only the hidden
states the drafter reads. On a CPU each linear layer's product runs on MKL or on a oneDNN-packed
copy of its weight, whichever was measured faster on this machine for its shape and row count.
Compiled (``compile=True``), a verify block is padded up to its bucket (1, 2, 4, 8, 16,
32, 64 tokens), so one graph serves every width up to it, and the cache's capacity comes from
a few powers of two, so the context growing never compiles again; compiled artefacts are kept
on disk (inductor's caches under ``$BLOCKSPEC_HOME/inductor``), so only the first run on a
machine pays for compiling.
"""

from __future__ import annotations

import os
import shutil
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from blockspec.decoding.costs import MEASURED_CONTEXT, CostModel, batch_cost_model, cost_model_for, measure_costs
from blockspec.decoding.block import VerifyBlock, static_mask
from blockspec.decoding.forward import TargetOutput
from blockspec.decoding.sequence import COMPILE_CHOICES
from blockspec.decoding.static_cache import (
    StaticKVCache,
    attend_through_static_cache,
    capacity_for,
)
from blockspec.decoding.verifier import TargetScores
from blockspec.errors import BlockspecError
from blockspec.models.packed import linear_layers, module_twin, packing_available, plan_kernels
from blockspec.models.quantized import parameter_count

#: Verify widths a compiled graph exists for; a block is padded up to the next one.
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: Model families whose decoder layers run in the fast path's loop (full attention, plain embeddings).
FAST_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def bucket_width(width: int) -> int:
    """The compiled width a block of ``width`` tokens runs at."""
    for bucket in WIDTH_BUCKETS:
        if width <= bucket:
            return bucket
    raise BlockspecError(f"a verify block of {width} tokens is wider than the fast path's widest, "
                         f"{WIDTH_BUCKETS[-1]}: use a smaller block size or tree budget, or --compile off")


def unsupported_reason(model) -> str | None:
    """Why the fast path cannot run ``model`` (None: it can)."""
    config = model.config
    if config.model_type not in FAST_FAMILIES:
        return f"the fast path runs {', '.join(FAST_FAMILIES)} targets, not {config.model_type}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types) or getattr(config, "use_sliding_window", False):
        return "the fast path needs full attention in every layer; this target has sliding-window layers"
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} does not have the decoder layout the fast path runs"
    return None


def layer_forward(model, input_ids, position_ids, mask, cache: StaticKVCache, feature_layers: tuple[int, ...],
                  last_only: bool = False):
    """Logits [B, W, V] (the last row only with ``last_only``) and the features of ``feature_layers``
    ([B, W, len * D], in that order; None for none), the cache written at ``cache.write_columns``."""
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    rope = inner.rotary_emb(hidden, position_ids)
    kept = {}
    for index, layer in enumerate(inner.layers):
        hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=position_ids, cache=cache)
        if index in feature_layers:
            kept[index] = hidden
    last = len(inner.layers) - 1
    if last in kept:  # Hugging Face's hidden_states[L] is the last layer's output after the final norm
        kept[last] = inner.norm(hidden)
    hidden = kept[last] if last in kept and not last_only else inner.norm(hidden[:, -1:] if last_only else hidden)
    features = torch.cat([kept[i] for i in feature_layers], dim=-1) if feature_layers else None
    return model.lm_head(hidden), features


@dataclass
class CompileStats:
    """What compiling cost: graphs built, and seconds spent in first calls (tracing + compiling)."""

    graphs: int = 0
    seconds: float = 0.0
    widths: list[int] = field(default_factory=list)


class FastForward:
    """The target's forward for the fast path, compiled per width bucket (or run eagerly with ``compile=False``).

    One per target and set of feature layers (``fast_forward`` keeps them); every stream and
    engine of that target shares it, and with it the compiled graphs.
    """

    def __init__(self, model, feature_layers: list[int] | None, *, compile: bool = True,
                 progress: Callable[[str], None] | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise BlockspecError(f"{reason}: use --compile off")
        self.model = model
        #: On a CPU, the kernel of each linear layer's product at each row count, as measured on this machine.
        self.kernels = plan_kernels(linear_layers(model), progress=progress) if packing_available(model) else None
        #: The network the loop runs: a twin of the model sharing its weights, on the planned kernels.
        self.network = module_twin(model, plan=self.kernels)
        attend_through_static_cache(self.network)
        self.feature_layers = tuple(feature_layers or ())
        self.compiled = compile
        self.progress = progress
        self.stats = CompileStats()
        # On a GPU each graph is also captured as a CUDA graph (the cache's buffers keep their addresses).
        mode = "reduce-overhead" if model.device.type == "cuda" else None
        self._graph = torch.compile(layer_forward, dynamic=False, mode=mode) if compile else layer_forward
        self._warm: set[tuple[int, int, int]] = set()
        if compile:
            configure_inductor()

    @property
    def path(self) -> str:
        """The forward path's name in the cost cache."""
        packed = self.kernels is not None and self.kernels.packs_any
        return "static" + (f"-{self.kernels.tag}" if packed else "") + ("-compiled" if self.compiled else "")

    def cost_model(self, model, widest: int) -> CostModel:
        """T(w) through this path (measuring it compiles every bucket up to ``widest`` on a first run)."""
        def measure(model, max_width):
            if self.progress is not None:
                self.progress(f"measuring the target's forward time at widths 1..{max_width} ({self.path})")
            length = MEASURED_CONTEXT + max_width + 1
            return measure_costs(model, max_width, new_target=lambda: StaticTarget(self, length))

        return cost_model_for(model, widest, measure=measure, path=self.path)

    def warm_up(self, widest: int, length: int) -> None:
        """Compile (or read from the disk cache) every width bucket up to ``widest`` for sequences of up to
        ``length`` positions, at every cache capacity such sequences take (a sequence's cache is allocated for
        its longest length), so that no decoding step pays for it."""
        if not self.compiled:
            return
        vocab = self.model.config.vocab_size
        capacities = [self.capacity(0)]
        while capacities[-1] < self.capacity(length):
            capacities.append(capacities[-1] * 2)  # capacities are powers of two
        with torch.inference_mode():  # as decoding runs: a graph is specialised to inference tensors
            for capacity in capacities:
                target = StaticTarget(self, capacity - WIDTH_BUCKETS[-1])
                target.prefill(torch.randint(0, vocab, (1, 8), device=self.model.device))
                for width in WIDTH_BUCKETS[:WIDTH_BUCKETS.index(bucket_width(widest)) + 1]:
                    target.verify([VerifyBlock(list(range(width)), 8)])
                    target.keep([[]])

    def capacity(self, length: int) -> int:
        """The cache capacity of sequences of up to ``length`` positions (plus the widest padding)."""
        context = getattr(self.model.config, "max_position_embeddings", None) or length
        return capacity_for(min(length, context) + WIDTH_BUCKETS[-1])

    def new_cache(self, length: int, batch: int = 1) -> StaticKVCache:
        """A cache for sequences of up to ``length`` positions (plus the widest padding)."""
        capacity = self.capacity(length)
        cache = StaticKVCache(self.model.config, batch, capacity, self.model.dtype, self.model.device)
        if self.compiled and self.model.device.type == "cuda":
            for buffer in (*cache.keys, *cache.values):  # written in place inside a CUDA graph
                torch._dynamo.mark_static_address(buffer)
        return cache

    def prefill(self, cache: StaticKVCache, row: int, input_ids: torch.LongTensor):
        """Run the prompt [1, P] into row ``row`` of the cache, eagerly (its length varies): last logits, features."""
        length = input_ids.shape[1]
        device = self.model.device
        cache.write_columns = torch.arange(length, device=device).unsqueeze(0)
        mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
        positions = torch.arange(length, device=device).unsqueeze(0)
        logits, features = layer_forward(self.network, input_ids, positions, mask, _RowView(cache, row),
                                         self.feature_layers, last_only=True)
        cache.lengths[row] = length
        return logits, features

    def verify(self, cache: StaticKVCache, blocks: list[VerifyBlock], starts: list[int]):
        """One forward over every row's block (padded to the bucket), row b's written at columns ``starts[b]``...:
        logits [B, Wb, V] and features."""
        device = self.model.device
        width = max(block.width for block in blocks)
        if self.compiled:
            width = bucket_width(width)
        ids = torch.zeros(len(blocks), width, dtype=torch.long)
        for row, block in enumerate(blocks):
            ids[row, :block.width] = torch.tensor(block.tokens, dtype=torch.long)
        columns = torch.tensor(starts).unsqueeze(1) + torch.arange(width).unsqueeze(0)
        positions = _positions(blocks, starts, width)
        # The attention reads the columns in use; on a GPU the whole capacity, so each graph keeps its shapes.
        read = cache.capacity if self.model.device.type == "cuda" else max(cache.lengths) + width
        mask = static_mask(cache.lengths, blocks, width, read, device)
        if self.compiled and read < cache.capacity:  # one graph for every length (the whole capacity is another)
            torch._dynamo.mark_dynamic(mask, 3, min=2, max=cache.capacity - 1)
        cache.write_columns = columns.to(device)
        return self._run(ids.to(device), positions.to(device), mask, cache)

    def _run(self, ids, positions, mask, cache):
        key = (ids.shape[0], ids.shape[1], cache.capacity)
        if key in self._warm or not self.compiled:
            return self._graph(self.network, ids, positions, mask, cache, self.feature_layers)
        allow_a_graph_per_shape()
        if self.progress is not None:
            self.progress(f"compiling the target's forward for {ids.shape[1]} tokens "
                          f"(batch {ids.shape[0]}, cache {cache.capacity}); a first run on this machine takes "
                          "up to a minute per width, later runs read it from the cache")
        started = time.perf_counter()
        out = self._graph(self.network, ids, positions, mask, cache, self.feature_layers)
        self.stats.graphs += 1
        self.stats.seconds += time.perf_counter() - started
        self.stats.widths.append(ids.shape[1])
        self._warm.add(key)
        return out


def _positions(blocks: list[VerifyBlock], starts: list[int], width: int) -> torch.Tensor:
    """[B, width]: each row's position, the start plus its depth; padding rows go on past the block."""
    return torch.stack([start + torch.tensor(block.depths + list(range(block.width, width)))
                        for block, start in zip(blocks, starts)])


class _RowView:
    """The cache as a one-row cache over row ``row`` (a new row is prefilled alone)."""

    def __init__(self, cache: StaticKVCache, row: int):
        self.cache, self.row = cache, row

    def update(self, key, value, layer_idx, **kwargs):
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        columns = self.cache.write_columns[0]
        keys[self.row, :, columns] = key[0]
        values[self.row, :, columns] = value[0]
        return keys[self.row:self.row + 1], values[self.row:self.row + 1]


class StaticTarget:
    """One sequence's target forwards through the fast path: a ``VerifyTarget`` over a static cache."""

    def __init__(self, fast: FastForward, length: int):
        self.fast = fast
        self.cache = fast.new_cache(length)

    def prefill(self, input_ids: torch.LongTensor) -> TargetOutput:
        logits, features = self.fast.prefill(self.cache, 0, input_ids)
        return TargetOutput(TargetScores(logits[0]), features)

    def verify(self, blocks: list[VerifyBlock]) -> list[TargetOutput]:
        (block,) = blocks
        logits, features = self.fast.verify(self.cache, [block], [self.cache.lengths[0]])
        width = block.width
        return [TargetOutput(TargetScores(logits[0, :width]), None if features is None else features[:, :width])]

    def keep(self, kept_rows: list[list[int]]) -> None:
        (rows,) = kept_rows
        self.cache.keep(0, rows)


class StaticBatchTarget:
    """The batch engine's target forwards through the fast path: rows in the leading slots of one static cache.

    A new row is prefilled into the next free slot; a leaving row's slot is refilled by moving the last
    row into it, so the active rows are always the first ones and a forward runs over exactly them.
    Rows keep their own lengths (their own columns), so nothing is ever left-padded or compacted.
    The cache grows (by doubling) as the longest row needs, and shrinks back when the rows that needed
    it leave, so memory follows the rows decoding rather than the longest answer a request may ask for.
    Runs eagerly (oneDNN-packed on a CPU): a batch's row count changes step to step.
    """

    def __init__(self, fast: FastForward, max_batch_size: int):
        self.fast = fast
        self.max_batch_size = max_batch_size
        self.cache = fast.new_cache(0, batch=max_batch_size)
        self.rows = 0

    @property
    def path(self) -> str:
        """The forward path's name in the cost cache."""
        return f"batch{self.max_batch_size}-{self.fast.path}"

    def cost_model(self, model, widest: int) -> CostModel:
        """T(B, w) of this path for 1..max_batch_size rows (measured once per machine, then read from disk)."""
        def fresh():
            target = StaticBatchTarget(self.fast, self.max_batch_size)
            target.reserve(MEASURED_CONTEXT + widest + 1)
            return target

        return batch_cost_model(model, widest, self.max_batch_size, fresh, self.path)

    def reserve(self, length: int) -> None:
        """Make room for a row of up to ``length`` positions (the cache grows; rows keep their entries)."""
        needed = self.fast.capacity(length)
        if needed > self.cache.capacity:
            self.cache = self.cache.resized(needed)

    def prefill(self, input_ids: torch.LongTensor) -> TargetOutput:
        row = self.rows
        logits, features = self.fast.prefill(self.cache, row, input_ids)
        self.rows += 1
        return TargetOutput(TargetScores(logits[0]), features)

    def verify(self, blocks: list[VerifyBlock]) -> list[TargetOutput]:
        self.reserve(max(b.start + b.width for b in blocks))
        view = self.cache.leading(len(blocks))
        logits, features = self.fast.verify(view, blocks, [b.start for b in blocks])
        return [TargetOutput(TargetScores(logits[r, :b.width]),
                             None if features is None else features[r:r + 1, :b.width])
                for r, b in enumerate(blocks)]

    def keep(self, kept_rows: list[list[int]]) -> None:
        for row, rows in enumerate(kept_rows):
            self.cache.keep(row, rows)

    def keep_sequences(self, indices: list[int]) -> None:
        """Only these rows (by index, in order) go on; the others leave their slots, and the cache shrinks to
        what the rows left need once that is half of it or less (it only shrinks when rows leave, so it
        cannot swing back and forth step by step)."""
        for slot, row in enumerate(indices):
            if row != slot:
                self.cache.move_row(row, slot)
        self.rows = len(indices)
        for slot in range(self.rows, self.cache.batch):
            self.cache.lengths[slot] = 0
        needed = self.fast.capacity(max(self.cache.lengths[:self.rows], default=0))
        if 2 * needed <= self.cache.capacity:
            self.cache = self.cache.resized(needed)


#: Graphs one compiled function may hold: a width bucket per batch size and cache capacity.
GRAPH_LIMIT = 64


def allow_a_graph_per_shape() -> None:
    """Raise dynamo's recompile limit (8) in the calling thread: its config is per thread, and a graph past the
    limit silently runs eagerly (a server decodes in a thread of its own)."""
    import torch._dynamo

    if torch._dynamo.config.recompile_limit < GRAPH_LIMIT:
        torch._dynamo.config.recompile_limit = GRAPH_LIMIT


def configure_inductor(cache_dir: str | None = None) -> None:
    """Keep inductor's compiled artefacts under BLOCKSPEC_HOME, and allow a graph per width bucket and capacity."""
    if cache_dir is None:
        from blockspec import hub

        cache_dir = str(hub.home_dir() / "inductor")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)  # before inductor reads it
    import torch._inductor.config as inductor

    inductor.fx_graph_cache = True
    allow_a_graph_per_shape()
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        raise BlockspecError("compiling the target needs a C++ compiler (g++): install one, or use --compile off")


#: On a CPU, compiling costs about a minute per width bucket once; below this size the eager forward's
#: overheads are not worth removing.
MIN_COMPILED_PARAMETERS = 50_000_000
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fast_forward(model, feature_layers: list[int] | None, *, compile: bool = True,
                 progress: Callable[[str], None] | None = None) -> FastForward:
    """The model's shared ``FastForward`` for these feature layers (created on first use).

    A caller that reads no features (plain AR) gets one that exists for some features, if any: the
    features cost next to nothing, and its compiled graphs are then shared with the drafting decodes.
    """
    per_model = _SHARED.setdefault(model, {})
    key = (tuple(feature_layers or ()), compile)
    if not feature_layers and key not in per_model:
        key = next((known for known in per_model if known[1] == compile), key)
    if key not in per_model:
        per_model[key] = FastForward(model, feature_layers, compile=compile, progress=progress)
    elif progress is not None:
        per_model[key].progress = progress
    return per_model[key]


def compile_choice(model, mode: str) -> tuple[bool, str]:
    """Whether to run the target through the compiled fast path under ``--compile mode``, and why.

    "on" insists (an unsupported target is an error); "auto" compiles a supported target on a GPU, or
    on a CPU when it is large enough for the saved time to pay for compiling; "off" never does.
    """
    if mode not in COMPILE_CHOICES:
        raise BlockspecError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {mode!r}")
    if mode == "off":
        return False, "compile off: the eager forward"
    reason = unsupported_reason(model)
    if reason is not None:
        if mode == "on":
            raise BlockspecError(f"{reason}: use --compile off")
        return False, f"{reason}; running eagerly"
    parameters = parameter_count(model)
    if mode == "auto" and model.device.type == "cpu" and parameters < MIN_COMPILED_PARAMETERS:
        return False, (f"a target of {parameters / 1e6:.1f}M parameters runs eagerly (compiling pays from "
                       f"{MIN_COMPILED_PARAMETERS / 1e6:.0f}M on a CPU)")
    return True, "compiled fast path: a static KV cache, one graph per verify width bucket"
