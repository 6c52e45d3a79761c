"""One sequence being decoded: its settings, its drafter's state, its tokens and its statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from blockspec.decoding.adjust import LogitAdjustments
from blockspec.decoding.cache import drafting_unsupported_reason, tree_unsupported_reason
from blockspec.decoding.grammar import Grammar, GrammarState
from blockspec.decoding.policy import AUTO, AdaptiveWidth, check_block_size
from blockspec.drafters.base import Drafter, DraftState, TreeDrafter
from blockspec.drafters.tree import DEFAULT_TREE_TOP_K
from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingConfig

#: ``GenerationConfig.compile`` values.
COMPILE_CHOICES = ("auto", "on", "off")
#: The most top tokens a position's log-probabilities may list (vLLM's default limit).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    #: Verify width (last token + block_size - 1 drafts); None: the drafter's default;
    #: "auto": chosen each step by the cost model (blockspec.decoding.policy).
    block_size: int | str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    #: Adjustments of the target's logits before each token is chosen (``blockspec.decoding.adjust``):
    #: vLLM's and OpenAI's penalties, a per-token bias ({token id: bias}), banned token sequences.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    #: How many of the prompt's last tokens are output generated earlier (a request resumed from its tokens so
    #: far): the adjustments over the output count them.
    earlier_output: int = 0
    #: What the output must match (``blockspec.decoding.grammar.Grammar``), None: anything.
    grammar: Grammar | None = None
    #: Each output token's log-probability, with this many of the most likely tokens' (None: none; at most 20).
    logprobs: int | None = None
    #: Tree verification: draft nodes per step (None: a chain), children per node at most.
    tree_budget: int | None = None
    tree_top_k: int = DEFAULT_TREE_TOP_K
    #: The target's forward: "off" the eager one over a dynamic cache; "on" the compiled fast path
    #: (a static cache, one graph per width bucket); "auto" the fast path where it pays.
    compile: str = "off"

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise BlockspecError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_block_size(self.block_size)
        if self.tree_budget is not None and self.tree_budget < 1:
            raise BlockspecError(f"tree_budget must be >= 1 draft nodes, got {self.tree_budget}")
        if self.tree_top_k < 1:
            raise BlockspecError(f"tree_top_k must be >= 1, got {self.tree_top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BlockspecError(f"logprobs must be between 0 and {MAX_LOGPROBS} top tokens, got {self.logprobs}")
        if self.earlier_output < 0:
            raise BlockspecError(f"earlier_output must be >= 0 tokens, got {self.earlier_output}")
        if self.compile not in COMPILE_CHOICES:
            raise BlockspecError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {self.compile!r}")

        if isinstance(self.logit_bias, dict):  # kept as pairs: the config stays hashable
            object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias.items()))
        object.__setattr__(self, "bad_words_ids", tuple(tuple(int(t) for t in word) for word in self.bad_words_ids))
        self.sampling  # validates the sampling values
        self.adjustments  # and the adjustments

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p, self.top_k, self.seed, self.min_p)

    @property
    def adjustments(self) -> LogitAdjustments:
        return LogitAdjustments(self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
                                tuple(self.logit_bias), self.bad_words_ids)


#: The token tree the command line, the demo and the server verify when the user names no width or
#: tree for a one-pass drafter: with the adaptive width it was the fastest on a CPU (SmolLM2-135M,
#: 12 prompts of gsm8k/humaneval/mt_bench: 1.30x mean over AR on the fast path, against 1.23x
#: for an adaptive chain and 1.27x for a 32-node tree).
PREFERRED_TREE_BUDGET = 16


def preferred_decoding(drafter: Drafter | None, config: GenerationConfig) -> GenerationConfig:
    """``config`` with the verify shape the command line and the demo use when the user names none:
    for a one-pass drafter (DFlash), the adaptive width over a 16-node token tree; else as given."""
    if config.block_size is None and isinstance(drafter, TreeDrafter) and config.tree_budget is None:
        return replace(config, block_size=AUTO, tree_budget=PREFERRED_TREE_BUDGET)
    return config


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target (its own distribution, as vLLM's raw logprobs), and the most
    likely tokens' at its position."""

    token: int
    #: None: nothing predicts the token (the first of an echoed prompt).
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Step:
    """Tokens one step produced (the first step is the prefill's token)."""

    tokens: list[int]
    num_drafted: int
    num_accepted: int
    #: Tokens the verify forward carried (None: the last token + the chain of drafts).
    num_verified: int | None = None
    #: The verify width the sequence's width policy chose this step (None: no choice made).
    chosen_width: int | None = None
    #: With ``GenerationConfig.logprobs``: each token's.
    logprobs: list[TokenLogprob] | None = None

    @property
    def width(self) -> int:
        """The verify block's width: the last token and its drafts (a tree's nodes)."""
        return self.num_verified if self.num_verified is not None else self.num_drafted + 1


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int = 0
    #: The decode steps as recorded (their tokens cut at a stop or the token limit): the per-step figures below
    #: are read from them.
    steps: list[Step] = field(default_factory=list)
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    #: Decode-phase wall time spent drafting (the drafter's passes, choosing the width) and verifying (the target's
    #: forward, acceptance, the drafter taking the kept tokens), summed over the steps.
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    finish_reason: str = ""

    @property
    def acceptance_lengths(self) -> list[int]:
        """Tokens each decode step produced (accepted drafts + 1, cut at a stop or the token limit)."""
        return [len(step.tokens) for step in self.steps]

    @property
    def drafted(self) -> list[int]:
        return [step.num_drafted for step in self.steps]

    @property
    def accepted(self) -> list[int]:
        return [step.num_accepted for step in self.steps]

    @property
    def verified(self) -> list[int]:
        """Tokens each decode step's verify forward carried (a tree's nodes + 1, a chain's drafts + 1)."""
        return [step.width for step in self.steps]

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

    @property
    def draft_ms_per_step(self) -> float:
        steps = len(self.acceptance_lengths)
        return 1000 * self.draft_seconds / steps if steps else 0.0

    @property
    def verify_ms_per_step(self) -> float:
        steps = len(self.acceptance_lengths)
        return 1000 * self.verify_seconds / steps if steps else 0.0

    @property
    def draft_share(self) -> float:
        """The drafter's share of a decode step's time (0 without a drafter)."""
        total = self.draft_seconds + self.verify_seconds
        return self.draft_seconds / total if total > 0 else 0.0

    def acceptance_by_position(self) -> list[float]:
        """P(draft k accepted | k drafted), k = 1..max drafted."""
        return acceptance_by_position(self.drafted, self.accepted)

    def to_dict(self) -> dict:
        data = {key: value for key, value in asdict(self).items() if key != "steps"}
        data.update(acceptance_lengths=self.acceptance_lengths, drafted=self.drafted, accepted=self.accepted,
                    verified=self.verified, tau=self.tau, tokens_per_s=self.tokens_per_s,
                    target_forwards=self.target_forwards, draft_ms_per_step=self.draft_ms_per_step,
                    verify_ms_per_step=self.verify_ms_per_step, draft_share=self.draft_share,
                    acceptance_by_position=self.acceptance_by_position())
        return data


def acceptance_by_position(drafted: list[int], accepted: list[int]) -> list[float]:
    """P(draft k accepted | k drafted), k = 1..max drafted, over steps given as (drafted, accepted) counts."""
    rates = []
    for k in range(1, max(drafted, default=0) + 1):
        tried = [a for a, d in zip(accepted, drafted) if d >= k]
        rates.append(sum(a >= k for a in tried) / len(tried))
    return rates


@dataclass
class Sequence:
    """Everything one sequence's decoding carries from step to step; the drafter's own part is ``draft_state``."""

    input_ids: torch.LongTensor
    config: GenerationConfig
    drafter: Drafter | None
    #: The widest verify this sequence may do (with "auto": the widest the policy may choose).
    block_size: int
    #: The token limit, lowered to what fits the model's context.
    max_new_tokens: int
    stats: GenerationStats
    #: With "auto": the policy choosing each step's width (or, with a tree, how many nodes).
    width_policy: AdaptiveWidth | None = None
    generator: torch.Generator | None = None
    draft_state: DraftState = None
    token_ids: list[int] = field(default_factory=list)
    #: With ``config.logprobs``: each of ``token_ids``' log-probability.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: With a grammar: its matcher, which has consumed ``token_ids``.
    grammar: GrammarState | None = None
    #: The next token to feed (picked by the target, not yet in its cache) and its position.
    last_token: int = 0
    position: int = 0

    @property
    def widths(self) -> list[int]:
        """The verify widths the width policy chose, step by step."""
        return [step.chosen_width for step in self.stats.steps if step.chosen_width is not None]

    @property
    def finished(self) -> bool:
        return bool(self.stats.finish_reason)

    @property
    def sampling(self) -> SamplingConfig:
        return self.config.sampling

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def draft_depth(self) -> int:
        """How many tokens to draft this step: the width allows, the token limit leaves room for the target's own."""
        depth = min(self.block_size - 1, self.max_new_tokens - len(self.token_ids) - 1)
        return 0 if self.drafter is None or depth <= 0 else depth

    def record(self, step: Step, *, decode: bool) -> Step:
        """Cut the step at a stop token or the token limit, append it to ``token_ids``, account for it."""
        tokens = step.tokens[: self.max_new_tokens - len(self.token_ids)]
        stop_at = next((i for i, t in enumerate(tokens) if t in self.config.stop_token_ids), None)
        if stop_at is not None:
            tokens = tokens[: stop_at + 1]
            self.stats.finish_reason = "stop"
        elif len(self.token_ids) + len(tokens) >= self.max_new_tokens:
            # the limit was lowered to fit the context: reaching it is "context", not "length"
            context_bound = self.max_new_tokens < self.config.max_new_tokens
            self.stats.finish_reason = "context" if context_bound else "length"
        step.tokens = tokens
        self.token_ids.extend(tokens)
        if step.logprobs is not None:
            step.logprobs = step.logprobs[:len(tokens)]
            self.logprobs.extend(step.logprobs)
        if self.grammar is not None:
            self.grammar.advance(tokens)
        self.stats.new_tokens = len(self.token_ids)
        if decode:
            self.stats.steps.append(step)
        return step


class SequenceView:
    """What a driver's handle on one sequence shows (a stream, an engine's row): its tokens and statistics."""

    sequence: Sequence

    @property
    def stats(self) -> GenerationStats:
        return self.sequence.stats

    @property
    def token_ids(self) -> list[int]:
        return self.sequence.token_ids

    @property
    def finished(self) -> bool:
        return self.sequence.finished


def new_sequence(model, input_ids, drafter: Drafter | None, config: GenerationConfig,
                 width_policy: AdaptiveWidth | None = None) -> Sequence:
    """A sequence ready for its prefill, its options checked (they fail here, not mid-decoding)."""
    ids = as_batch_of_one(input_ids, model.device)
    check_tree_drafter(drafter, config.tree_budget)
    check_drafting_target(model, drafter)
    config.adjustments.check_vocabulary(model.config.get_text_config(decoder=True).vocab_size)
    if config.earlier_output > ids.shape[1]:
        raise BlockspecError(f"earlier_output {config.earlier_output} is more than the prompt's {ids.shape[1]} tokens")
    config = chain_unless_trees_verify(model, config)
    return Sequence(input_ids=ids, config=config, drafter=drafter,
                    block_size=resolve_block_size(drafter, config.block_size),
                    max_new_tokens=fit_to_context(model, ids.shape[1], config.max_new_tokens),
                    stats=GenerationStats(prompt_tokens=ids.shape[1]), width_policy=width_policy,
                    grammar=config.grammar.start() if config.grammar is not None else None)


def adapts_width(config: GenerationConfig) -> bool:
    """Whether a width policy chooses the sequence's verify width step by step ("auto").

    Not for a seeded sampled sequence: which random draws it makes depends on the widths, and the widths
    on what the policy has learnt so far (and on timings), so the same seed would not give the same text
    twice. It verifies at the widest width every step instead."""
    return config.block_size == AUTO and (config.seed is None or config.sampling.greedy)


def widest_verify(drafter: Drafter | None, config: GenerationConfig) -> int:
    """The widest verify forward a decode under ``config`` may run: a tree's nodes + 1, else the block size
    (with "auto": the widest the policy may choose)."""
    if drafter is None:
        return 1
    if config.tree_budget:
        return config.tree_budget + 1
    return resolve_block_size(drafter, AUTO if config.block_size == AUTO else config.block_size)


def check_tree_drafter(drafter: Drafter | None, tree_budget: int | None) -> None:
    """Only a tree drafter proposes a token tree."""
    if tree_budget and not isinstance(drafter, TreeDrafter):
        raise BlockspecError("a token tree needs a drafter that proposes one (dflash, suffix, dflash+suffix, "
                             f"dflash+lookup), not {'no drafter' if drafter is None else drafter.name}: "
                             "drop --tree-budget or choose one of those methods")


def check_drafting_target(model, drafter: Drafter | None) -> None:
    """Drafts are verified only on targets whose block verify equals decoding token by token."""
    reason = None if drafter is None else drafting_unsupported_reason(model)
    if reason is not None:
        raise BlockspecError(f"{model.config.model_type} targets cannot verify drafts losslessly: {reason}; "
                             "decode without a drafter")


def chain_unless_trees_verify(model, config: GenerationConfig) -> GenerationConfig:
    """On a target whose layers cannot verify a token tree in one forward (a linear-attention state
    follows one sequence: ``tree_unsupported_reason``), the drafter's chain is verified instead, at the
    block size asked for (or the drafter's own)."""
    if config.tree_budget and tree_unsupported_reason(model) is not None:
        return replace(config, tree_budget=None)
    return config


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


def fit_to_context(model, prompt_length: int, max_new_tokens: int) -> int:
    context = getattr(model.config, "max_position_embeddings", None)
    if context is None:
        return max_new_tokens
    if prompt_length >= context:
        raise BlockspecError(
            f"the prompt has {prompt_length} tokens but the model's context is {context}: shorten the prompt"
        )
    return min(max_new_tokens, context - prompt_length)


def as_batch_of_one(input_ids, device) -> torch.LongTensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise BlockspecError(f"input_ids must be one sequence ([T] or [1, T]), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise BlockspecError("the prompt is empty: give at least one token")
    return ids
