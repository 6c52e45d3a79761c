"""The speculative decoding loop: a stream of token steps, with its statistics at the end.

prefill (with hidden states) -> [draft -> verify the block in one target forward ->
accept -> crop the target cache -> hand the accepted positions' features to the drafter]*.
Without a drafter the same loop decodes one token per forward (plain autoregressive).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from blockspec.decoding.adaptive import AUTO, AdaptiveWidth, check_block_size, cost_model_for
from blockspec.decoding.drafter import Drafter, Proposal
from blockspec.sampling import SamplingConfig, pick_tokens
from blockspec.decoding.tree import (DEFAULT_TREE_TOP_K, build_tree, keep_path, tree_attention_mask,
                                     tree_position_ids, verify_tree)
from blockspec.decoding.verifier import verify
from blockspec.errors import BlockspecError


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    #: Verify width (last token + block_size - 1 drafts); None: the drafter's default;
    #: "auto": chosen each step by the cost model (blockspec.decoding.adaptive).
    block_size: int | str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    #: Tree verification: draft nodes per step (None: a chain), children per node at most.
    tree_budget: int | None = None
    tree_top_k: int = DEFAULT_TREE_TOP_K

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise BlockspecError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_block_size(self.block_size)
        if self.tree_budget is not None and self.tree_budget < 1:
            raise BlockspecError(f"tree_budget must be >= 1 draft nodes, got {self.tree_budget}")
        if self.tree_top_k < 1:
            raise BlockspecError(f"tree_top_k must be >= 1, got {self.tree_top_k}")

        self.sampling  # validates the sampling values

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p, self.top_k, self.seed)


@dataclass
class Step:
    """Tokens one loop step produced (the first step is the prefill's token)."""

    tokens: list[int]
    num_drafted: int
    num_accepted: int
    #: Tokens the verify forward carried (None: the last token + the chain of drafts).
    num_verified: int | None = None


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int = 0
    #: Tokens each decode step produced (accepted drafts + 1, cut at a stop or the token limit).
    acceptance_lengths: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    #: Tokens each decode step's verify forward carried (a tree's nodes + 1, a chain's drafts + 1).
    verified: list[int] = field(default_factory=list)
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    finish_reason: str = ""

    @property
    def tau(self) -> float:
        """Tokens per target forward in the decode phase (the bonus token included)."""
        steps = self.acceptance_lengths
        return sum(steps) / len(steps) if steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def target_forwards(self) -> int:
        return 1 + len(self.acceptance_lengths)

    def acceptance_by_position(self) -> list[float]:
        """P(draft k accepted | k drafted), k = 1..max drafted."""
        return acceptance_by_position(self.drafted, self.accepted)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(tau=self.tau, tokens_per_s=self.tokens_per_s, target_forwards=self.target_forwards,
                    acceptance_by_position=self.acceptance_by_position())
        return data


class TokenStream:
    """Iterate for ``Step``s as they are decoded; ``stats`` and ``token_ids`` fill in as it runs."""

    def __init__(self, target_model, input_ids: torch.LongTensor, drafter: Drafter | None, config: GenerationConfig):
        self.model = target_model
        self.input_ids = _as_batch_of_one(input_ids, target_model.device)
        self.drafter = drafter
        self.config = config
        self.block_size = resolve_block_size(drafter, config.block_size)
        #: With "auto", the policy choosing each step's width (or, with a tree, how many nodes);
        #: ``widths`` records this stream's choices.
        self.width_policy = shared_width_policy(target_model, drafter, config) if config.block_size == AUTO else None
        self.widths: list[int] = []
        check_tree_drafter(drafter, config.tree_budget)
        self.max_new_tokens = _fit_to_context(target_model, self.input_ids.shape[1], config.max_new_tokens)
        self.stats = GenerationStats(prompt_tokens=self.input_ids.shape[1])
        self.token_ids: list[int] = []

    def __iter__(self):
        with torch.inference_mode():
            yield from self._run()

    def _run(self):
        sampling = self.config.sampling
        generator = sampling.make_generator(self.model.device) if not sampling.greedy else None
        stop_ids = set(self.config.stop_token_ids)
        wants_features = self.drafter is not None and self.drafter.feature_layers is not None
        cache = DynamicCache(config=self.model.config)
        start_time = wall_clock(self.model.device)

        out = self.model(input_ids=self.input_ids, cache=cache, use_cache=True,
                         logits_to_keep=1, output_hidden_states=wants_features)
        token = int(pick_tokens(out.logits[0, -1], sampling, generator))
        if self.drafter is not None:
            self.drafter.begin(self.input_ids, self._features(out) if wants_features else None)
        self.stats.time_to_first_token = wall_clock(self.model.device) - start_time
        yield self._record(Step([token], 0, 0), stop_ids, start_time)

        position = self.input_ids.shape[1]  # where `token` goes; the cache holds everything before it
        while not self.stats.finish_reason:
            depth = min(self.block_size - 1, self.max_new_tokens - len(self.token_ids) - 1)
            if self.width_policy is not None and depth > 0 and not self.width_policy.should_draft():
                depth = 0  # drafting has not been paying: a plain one-token step
            if self.config.tree_budget and depth > 0:
                step = self._tree_step(token, position, depth, cache, sampling, generator, wants_features)
            else:
                step = self._chain_step(token, position, depth, cache, sampling, generator, wants_features)
            position += step.num_accepted + 1  # the last token and the accepted drafts entered the cache
            token = step.tokens[-1]
            yield self._record(step, stop_ids, start_time, decode=True)

    def _chain_step(self, token, position, num_drafts, cache, sampling, generator, wants_features) -> Step:
        """Draft a chain, verify it in one forward, keep the accepted prefix."""
        drafting = wall_clock(self.model.device) if self.width_policy else 0.0
        proposal = self._propose(token, num_drafts, sampling, generator)
        proposal, confidences, verifying = self._choose_width(proposal, drafting)
        block = torch.cat([torch.tensor([token], device=self.model.device), proposal.tokens]).unsqueeze(0)
        out = self.model(input_ids=block, position_ids=positions(position, block.shape[1], block.device),
                         cache=cache, use_cache=True, output_hidden_states=wants_features)
        verdict = verify(proposal.tokens, out.logits[0], sampling, proposal.probs, generator)
        if confidences is not None:  # it drafted, even if it then chose to verify no draft (width 1)
            self.width_policy.observe(confidences, verdict.num_accepted, wall_clock(self.model.device) - verifying,
                                      block.shape[1], verifying - drafting)
        kept = verdict.num_accepted + 1
        cache.crop(kept - block.shape[1])
        self._commit(block[:, :kept], out, list(range(kept)) if wants_features else None)
        new_tokens = proposal.tokens[: verdict.num_accepted].tolist() + [verdict.next_token]
        return Step(new_tokens, len(proposal.tokens), verdict.num_accepted)

    def _tree_step(self, token, position, depth, cache, sampling, generator, wants_features) -> Step:
        """Draft a token tree from one draft pass, verify every node in one forward, keep the accepted path."""
        drafting = wall_clock(self.model.device) if self.width_policy else 0.0
        probs = torch.softmax(self.drafter.draft_logits(token, depth).float(), dim=-1)
        tree = build_tree(probs, self.config.tree_budget, self.config.tree_top_k)
        if self.width_policy is not None:
            verifying = wall_clock(self.model.device)
            confidences = [float(probs[d - 1, t]) for t, d in zip(tree.tokens, tree.depths)]
            tree = tree.first(self.width_policy.choose_tree_size(confidences, tree.parents))
            self.widths.append(len(tree) + 1)
        block = torch.tensor([[token] + tree.tokens], device=self.model.device)
        out = self.model(input_ids=block, position_ids=tree_position_ids(tree, position, block.device),
                         attention_mask=tree_attention_mask(tree, position, self.model.dtype, block.device),
                         cache=cache, use_cache=True, output_hidden_states=wants_features)
        verdict = verify_tree(tree, out.logits[0], sampling, generator)
        if self.width_policy is not None:
            self.width_policy.observe_tree(tree.walked_levels(verdict.path, confidences),
                                           wall_clock(self.model.device) - verifying, block.shape[1],
                                           verifying - drafting)
        kept_rows = [0] + [1 + node for node in verdict.path]
        keep_path(cache, position, kept_rows)
        self._commit(block[:, kept_rows], out, kept_rows if wants_features else None)
        new_tokens = [tree.tokens[node] for node in verdict.path] + [verdict.next_token]
        return Step(new_tokens, max(tree.depths, default=0), len(verdict.path), num_verified=block.shape[1])

    def _commit(self, kept_ids, out, feature_rows) -> None:
        if self.drafter is not None:
            features = self._features(out)[:, feature_rows] if feature_rows is not None else None
            self.drafter.commit(kept_ids, features)

    def _propose(self, token, num_tokens, sampling, generator) -> Proposal:
        if self.drafter is None or num_tokens <= 0:
            return Proposal.empty(self.model.device)
        return self.drafter.propose(token, num_tokens, sampling, generator)

    def _choose_width(self, proposal: Proposal, drafting: float):
        """With adaptive width: the proposal cut to the chosen width, its confidences, the time verifying starts."""
        if self.width_policy is None or len(proposal.tokens) == 0:
            return proposal, None, 0.0
        verifying = wall_clock(self.model.device)
        confidences = proposal.confidences()
        width = self.width_policy.choose(confidences)
        self.widths.append(width)
        return proposal.truncated(width - 1), confidences[: width - 1], verifying

    def _features(self, out) -> torch.Tensor:
        return torch.cat([out.hidden_states[i + 1] for i in self.drafter.feature_layers], dim=-1)

    def _record(self, step: Step, stop_ids: set[int], start_time: float, decode: bool = False) -> Step:
        record_step(step, self.token_ids, self.stats, stop_ids, self.max_new_tokens,
                    self.max_new_tokens < self.config.max_new_tokens, decode)
        self.stats.total_time = wall_clock(self.model.device) - start_time
        return step


def record_step(step: Step, token_ids: list[int], stats: GenerationStats, stop_ids, max_new_tokens: int,
                context_bound: bool, decode: bool) -> Step:
    """Cut the step at a stop token or the token limit, append it to ``token_ids``, account for it.

    ``context_bound``: ``max_new_tokens`` was lowered to fit the context, so reaching it is
    finish reason "context", not "length".
    """
    tokens = step.tokens[: max_new_tokens - len(token_ids)]
    stop_at = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    if stop_at is not None:
        tokens = tokens[: stop_at + 1]
        stats.finish_reason = "stop"
    elif len(token_ids) + len(tokens) >= max_new_tokens:
        stats.finish_reason = "context" if context_bound else "length"
    step.tokens = tokens
    token_ids.extend(tokens)
    stats.new_tokens = len(token_ids)
    if decode:
        stats.acceptance_lengths.append(len(tokens))
        stats.drafted.append(step.num_drafted)
        stats.accepted.append(step.num_accepted)
        stats.verified.append(step.num_verified if step.num_verified is not None else step.num_drafted + 1)
    return step


def acceptance_by_position(drafted: list[int], accepted: list[int]) -> list[float]:
    """P(draft k accepted | k drafted), k = 1..max drafted, over steps given as (drafted, accepted) counts."""
    rates = []
    for k in range(1, max(drafted, default=0) + 1):
        tried = [a for a, d in zip(accepted, drafted) if d >= k]
        rates.append(sum(a >= k for a in tried) / len(tried))
    return rates


def speculative_generate(target_model, input_ids, drafter: Drafter | None = None,
                         config: GenerationConfig | None = None) -> TokenStream:
    """A lazy stream of decoding steps; without a drafter, plain autoregressive decoding."""
    return TokenStream(target_model, input_ids, drafter, config or GenerationConfig())


def shared_width_policy(target_model, drafter, config: GenerationConfig) -> AdaptiveWidth:
    """The drafter's adaptive-width policy, kept on the drafter so its calibration carries over prompts.

    With a tree, "auto" chooses how many of its nodes to verify (costs up to budget + 1 wide).
    """
    widest = config.tree_budget + 1 if config.tree_budget else resolve_block_size(drafter, AUTO)
    key = ("tree" if config.tree_budget else "chain", widest)
    policies = drafter.__dict__.setdefault("width_policies", {})
    if key not in policies:
        policies[key] = AdaptiveWidth(cost_model_for(target_model, widest))
    return policies[key]


def check_tree_drafter(drafter: Drafter | None, tree_budget: int | None) -> None:
    """A token tree is drafted from one pass's per-position distributions: only DFlash offers them."""
    if tree_budget and not hasattr(drafter, "draft_logits"):
        raise BlockspecError("tree verification (--tree-budget) drafts from one pass's per-position distributions: "
                             f"it needs the dflash drafter, not {'no drafter' if drafter is None else drafter.name}")


def resolve_block_size(drafter: Drafter | None, requested: int | str | None) -> int:
    """The verify width (with "auto": the widest the policy may choose)."""
    if requested == AUTO:
        if drafter is None:
            raise BlockspecError("block_size 'auto' needs a drafter: without one, decoding is one token per step")
        limit = drafter.max_draft_tokens
        return limit + 1 if limit is not None else drafter.default_block_size
    if drafter is None:
        if requested not in (None, 1):
            raise BlockspecError(f"block_size {requested} needs a drafter: without one, decoding is one token per step")
        return 1
    size = drafter.default_block_size if requested is None else requested
    if drafter.max_draft_tokens is not None and size - 1 > drafter.max_draft_tokens:
        raise BlockspecError(
            f"block_size {size} is above the {drafter.name} drafter's trained block size "
            f"{drafter.max_draft_tokens + 1}: choose {drafter.max_draft_tokens + 1} or less"
        )
    return size


def _fit_to_context(model, prompt_length: int, max_new_tokens: int) -> int:
    context = getattr(model.config, "max_position_embeddings", None)
    if context is None:
        return max_new_tokens
    if prompt_length >= context:
        raise BlockspecError(
            f"the prompt has {prompt_length} tokens but the model's context is {context}: shorten the prompt"
        )
    return min(max_new_tokens, context - prompt_length)


def _as_batch_of_one(input_ids, device) -> torch.LongTensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise BlockspecError(f"input_ids must be one sequence ([T] or [1, T]), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise BlockspecError("the prompt is empty: give at least one token")
    return ids


def positions(start: int, length: int, device) -> torch.LongTensor:
    """Position ids [1, length] starting at ``start``."""
    return torch.arange(start, start + length, device=device).unsqueeze(0)


def wall_clock(device) -> float:
    """perf_counter after the device has finished its queued work (so timings include it)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()
