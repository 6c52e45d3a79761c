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

import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from blockspec.decoding.block import VerifyBlock, static_mask
from blockspec.decoding.compile_policy import allow_a_graph_per_shape, configure_inductor, unsupported_reason
from blockspec.decoding.static_cache import StaticKVCache, attend_through_static_cache, capacity_for
from blockspec.errors import BlockspecError
from blockspec.models.packed import linear_layers, module_twin, packing_available, plan_kernels

#: Verify widths a compiled graph exists for; a block is padded up to the next one.
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_width(width: int) -> int:
    """The compiled width a block of ``width`` tokens runs at."""
    for bucket in WIDTH_BUCKETS:
        if width <= bucket:
            return bucket
    raise BlockspecError(f"a verify block of {width} tokens is wider than the fast path's widest, "
                         f"{WIDTH_BUCKETS[-1]}: use a smaller block size or tree budget, or --compile off")


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
                cache = self.new_cache(capacity - WIDTH_BUCKETS[-1])
                self.prefill(cache, 0, torch.randint(0, vocab, (1, 8), device=self.model.device))
                for width in WIDTH_BUCKETS[:WIDTH_BUCKETS.index(bucket_width(widest)) + 1]:
                    self.verify(cache, [VerifyBlock(list(range(width)), 8)], [8])
                    cache.keep(0, [])

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

    def prefill(self, cache: StaticKVCache, row: int, input_ids: torch.LongTensor, start: int = 0):
        """Run the prompt [1, P] (or its part from position ``start``, after the part before it) into row ``row`` of
        the cache, eagerly (its length varies): last logits, features."""
        length = input_ids.shape[1]
        device = self.model.device
        columns = torch.arange(start, start + length, device=device).unsqueeze(0)
        cache.write_columns = columns
        mask = torch.ones(length, start + length, dtype=torch.bool, device=device).tril(diagonal=start)[None, None]
        logits, features = layer_forward(self.network, input_ids, columns, mask, _RowView(cache, row),
                                         self.feature_layers, last_only=True)
        cache.lengths[row] = start + length
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
