"""The one speculative step every driver runs: draft -> verify in one target forward -> accept -> commit.

    prefill_step:  the prompt enters the target's cache (``start_sequence`` after a prompt prefilled in
                   chunks); its first token; the drafter starts.
    decode_step:   each sequence drafts (a chain or a token tree); an adaptive-width policy cuts the
                   drafts of the rows it serves to the one width that pays best for the whole
                   forward; ONE target forward verifies every sequence's block; the verifier accepts
                   a prefix (or a tree path) and the target's next token; the target keeps the
                   accepted rows (``VerifyTarget.keep``, the rollback); the drafter commits them
                   with the target's features there; the policies learn from the verdicts and the
                   step's times.
    end_sequence:  the drafter sees the whole answer (what a drafter that copies keeps).

The single-sequence stream, the batch engine and replay differ only in the ``VerifyTarget``
they pass (one sequence's cache, many rows in one padded forward, a recorded answer). Without
a drafter a step verifies the last token alone: plain autoregressive decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from blockspec.clock import wall_clock
from blockspec.decoding.adjust import adjust_scores, constrained_scores
from blockspec.decoding.block import VerifyBlock
from blockspec.decoding.forward import TargetOutput, VerifyTarget
from blockspec.decoding.policy import AdaptiveWidth
from blockspec.decoding.sequence import Sequence, Step, TokenLogprob
from blockspec.decoding.verifier import TargetScores, Verdict, verify_block
from blockspec.sampling import sample_from


@dataclass
class Draft:
    """One sequence's drafts for this step, each with its parent among them (-1: the root; None: a chain),
    listed parents first and best first; ``block`` is what the target verifies: the last token, then the
    drafts."""

    root: int
    position: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] | None = None
    #: [n, V]: the distribution each draft of a chain was sampled from (None: deterministic drafts).
    probs: torch.Tensor | None = None
    #: With an adaptive width: the drafter's confidence in each draft, and the width the policy chose.
    confidences: list[float] | None = None
    chosen_width: int | None = None

    @property
    def size(self) -> int:
        return len(self.tokens)

    def cut(self, width: int) -> None:
        """Verify only the first ``width - 1`` drafts (a chain's prefix; a tree's best nodes, still a tree)."""
        count = width - 1
        self.tokens = self.tokens[:count]
        self.parents = None if self.parents is None else self.parents[:count]
        self.probs = None if self.probs is None else self.probs[:count]
        self.confidences = self.confidences[:count]
        self.__dict__.pop("block", None)  # a block made before the cut is stale

    @cached_property
    def block(self) -> VerifyBlock:
        return VerifyBlock([self.root, *self.tokens], self.position, self.parents)


def prefill_step(target: VerifyTarget, sequence: Sequence) -> Step:
    """The prompt enters the target's cache; the target picks the first token; the drafter starts."""
    return start_sequence(sequence, target.prefill(sequence.input_ids))


def start_sequence(sequence: Sequence, out: TargetOutput) -> Step:
    """Once the whole prompt is in the target's cache (``out``: its last position's scores, every position's
    features): the target picks the first token; the drafter starts."""
    sampling = sequence.sampling
    sequence.generator = None if sampling.greedy else sampling.make_generator(sequence.device)
    sequence.last_token = _first_token(out.scores, sequence)
    sequence.position = sequence.input_ids.shape[1]
    if sequence.drafter is not None:
        sequence.draft_state = sequence.drafter.start(sequence.input_ids, out.features)
    logprobs = token_logprobs(out.scores, [-1], [sequence.last_token], sequence.config.logprobs)
    return sequence.record(Step([sequence.last_token], 0, 0, logprobs=logprobs), decode=False)


def end_sequence(sequence: Sequence) -> None:
    """The sequence will not step again (finished or cancelled): its drafter sees the answer."""
    if sequence.drafter is not None and sequence.draft_state is not None:
        sequence.drafter.finish(sequence.draft_state, list(sequence.token_ids))


def decode_step(target: VerifyTarget, sequences: list[Sequence]) -> list[Step]:
    """One step of every sequence, their blocks verified together in one target forward."""
    device = sequences[0].device
    began = wall_clock(device)
    groups = width_groups(sequences)
    drafting = {id(policy): policy.should_draft(len(sequences)) for policy, _ in groups}
    drafts = draft_rows(sequences, [drafting.get(id(sequence.width_policy), True) for sequence in sequences])
    fit_widths(groups, sequences, drafts)
    drafted = wall_clock(device)
    outputs = target.verify([d.block for d in drafts])
    verdicts = [accept(sequence, d, out) for sequence, d, out in zip(sequences, drafts, outputs)]
    target.keep([verdict.kept_rows for verdict in verdicts])
    kept = wall_clock(device)
    steps = [commit(*args) for args in zip(sequences, drafts, verdicts, outputs)]
    verified = wall_clock(device)
    learn_widths(groups, sequences, drafts, verdicts, steps, draft_seconds=drafted - began,
                 verify_seconds=kept - drafted)
    for sequence in sequences:  # a batch's rows wait for every row's drafts and for the one verify forward
        if sequence.drafter is not None:
            sequence.stats.draft_seconds += drafted - began
        sequence.stats.verify_seconds += verified - drafted
    return steps


def width_groups(sequences: list[Sequence]) -> list[tuple[AdaptiveWidth, list[int]]]:
    """The adaptive-width policies of these sequences, each with the indices of the sequences it serves."""
    groups: dict[int, tuple[AdaptiveWidth, list[int]]] = {}
    for index, sequence in enumerate(sequences):
        if sequence.width_policy is not None:
            groups.setdefault(id(sequence.width_policy), (sequence.width_policy, []))[1].append(index)
    return list(groups.values())


def draft_rows(sequences: list[Sequence], drafting: list[bool]) -> list[Draft]:
    """Every sequence's drafts at full depth (none where drafting does not pay this step or has no room). The
    token trees of rows that share a drafter and a tree's shape are drafted together, in one pass where the
    drafter can."""
    drafts = [Draft(sequence.last_token, sequence.position) for sequence in sequences]
    trees: dict[tuple, list[int]] = {}
    for index, (sequence, drafts_now) in enumerate(zip(sequences, drafting)):
        depth = sequence.draft_depth() if drafts_now else 0
        config = sequence.config
        if depth > 0 and config.tree_budget:
            trees.setdefault((id(sequence.drafter), depth, config.tree_budget, config.tree_top_k), []).append(index)
        elif depth > 0:
            proposal = sequence.drafter.propose(sequence.draft_state, sequence.last_token, depth,
                                                sequence.sampling, sequence.generator)
            drafts[index].tokens, drafts[index].probs = proposal.tokens.tolist(), proposal.probs
            _note_confidences(drafts[index], sequence, proposal.confidences())
    for (_, depth, budget, top_k), rows in trees.items():
        drafter = sequences[rows[0]].drafter
        drafted = drafter.draft_trees([sequences[i].draft_state for i in rows], [sequences[i].last_token for i in rows],
                                      depth, budget, top_k)
        for index, (tree, confidences) in zip(rows, drafted):
            drafts[index].tokens, drafts[index].parents = tree.tokens, tree.parents
            _note_confidences(drafts[index], sequences[index], confidences)
    for sequence, drafted in zip(sequences, drafts):
        if sequence.grammar is not None and drafted.size:
            follow_grammar(drafted, sequence)
    return drafts


def follow_grammar(drafted: Draft, sequence: Sequence) -> None:
    """A constrained sequence's drafts: the tokens its grammar forces next, when it forces any; else the drafter's,
    without the drafts the grammar refuses (they could never be accepted). Not a sampled chain's: where it is cut
    would depend on its draws, and a refused draw is answered from the residual, not from p."""
    forced = sequence.grammar.forced_tokens()[:drafted.size]
    if forced:
        drafted.tokens, drafted.parents, drafted.probs = forced, None, None
        drafted.confidences = None if drafted.confidences is None else [1.0] * len(forced)
        drafted.__dict__.pop("block", None)
        return
    if drafted.probs is not None:
        return
    allowed = sequence.grammar.allowed_paths(drafted.block.paths[1:])
    drafted.__dict__.pop("block", None)
    kept = [node for node, ok in enumerate(allowed) if ok]  # a node's path holds its parent's: parents stay kept
    renumber = {node: index for index, node in enumerate(kept)}
    drafted.tokens = [drafted.tokens[node] for node in kept]
    if drafted.parents is not None:
        drafted.parents = [renumber.get(drafted.parents[node], -1) for node in kept]
    if drafted.confidences is not None:
        drafted.confidences = [drafted.confidences[node] for node in kept]


def _note_confidences(drafted: Draft, sequence: Sequence, confidences: list[float] | None) -> None:
    """What the sequence's width policy chooses by (none without a policy, or without drafts)."""
    if sequence.width_policy is not None and drafted.size > 0:
        drafted.confidences = confidences


def fit_widths(groups, sequences: list[Sequence], drafts: list[Draft]) -> None:
    """Each policy cuts the drafts of its rows to the one width that pays best for the whole forward."""
    for policy, members in groups:
        chosen = [i for i in members if drafts[i].confidences is not None]
        if not chosen:
            continue
        others = [d.size + 1 for i, d in enumerate(drafts) if i not in members]
        expected = [_expected_tokens(policy, drafts[i]) for i in chosen]
        width = policy.choose_width(expected, batch=len(drafts), floor=max(others, default=1))
        for i in chosen:
            drafts[i].cut(min(width, drafts[i].size + 1))
            drafts[i].chosen_width = drafts[i].size + 1


def _expected_tokens(policy: AdaptiveWidth, drafted: Draft) -> list[float]:
    return policy.expected_tokens(drafted.confidences, drafted.parents)


def accept(sequence: Sequence, drafted: Draft, out: TargetOutput) -> Verdict:
    """The verifier's decision on one sequence's block, each row scored as plain decoding would score it."""
    scores = _adjusted(out.scores, sequence, drafted.block)
    return verify_block(drafted.block, scores, sequence.sampling, drafted.probs, sequence.generator)


def commit(sequence: Sequence, drafted: Draft, verdict: Verdict, out: TargetOutput) -> Step:
    """The accepted tokens and the target's next one join the sequence; the drafter sees the kept rows."""
    block, kept = drafted.block, verdict.kept_rows
    kept_tokens = [block.tokens[row] for row in kept]
    if sequence.drafter is not None:
        features = None if out.features is None else out.features[:, kept]
        ids = torch.tensor([kept_tokens], dtype=torch.long, device=sequence.device)
        sequence.drafter.commit(sequence.draft_state, ids, features)
    sequence.position += len(kept)
    sequence.last_token = verdict.next_token
    new_tokens = kept_tokens[1:] + [verdict.next_token]
    step = Step(new_tokens, max(block.depths), verdict.num_accepted, num_verified=block.width,
                chosen_width=drafted.chosen_width,
                logprobs=token_logprobs(out.scores, kept, new_tokens, sequence.config.logprobs))
    return sequence.record(step, decode=True)


def token_logprobs(scores: TargetScores, rows: list[int], tokens: list[int], top: int | None):
    """Each token's log-probability at the row of the verified block that predicts it, and the ``top`` most likely
    tokens' there (None: none asked for)."""
    if top is None:
        return None
    logprobs = torch.log_softmax(scores.logits_for("log-probabilities")[rows].float(), dim=-1)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    return [TokenLogprob(token, value, () if best is None else
                         tuple(zip(best.indices[i].tolist(), best.values[i].tolist())))
            for i, (token, value) in enumerate(zip(tokens, chosen))]


def learn_widths(groups, sequences: list[Sequence], drafts: list[Draft], verdicts: list[Verdict], steps: list[Step],
                 *, draft_seconds: float, verify_seconds: float) -> None:
    """Each policy learns from its rows' verdicts, and from the step's times if its rows drafted."""
    width = max(d.block.width for d in drafts)
    tokens = sum(len(step.tokens) for step in steps)
    for policy, members in groups:
        drafted = [i for i in members if drafts[i].confidences is not None]
        for i in drafted:
            _observe_verdict(policy, drafts[i], verdicts[i])
        if drafted:
            policy.observe_step(rows=len(drafted), batch=len(drafts), width=width, tokens=tokens,
                                draft_seconds=draft_seconds, verify_seconds=verify_seconds)


def _observe_verdict(policy: AdaptiveWidth, drafted: Draft, verdict: Verdict) -> None:
    policy.observe(drafted.confidences, drafted.parents, list(verdict.path))


def _adjusted(scores: TargetScores, sequence: Sequence, block: VerifyBlock | None = None) -> TargetScores:
    """The scores with the sequence's logit adjustments and grammar applied, each row in its own context."""
    adjustments = sequence.config.adjustments
    if adjustments.active:
        cut = sequence.input_ids.shape[1] - sequence.config.earlier_output
        output = sequence.input_ids[0, cut:].tolist() + sequence.token_ids
        scores = adjust_scores(scores, adjustments, sequence.input_ids[:, :cut], output, block)
    if sequence.grammar is not None:
        scores = constrained_scores(scores, sequence.grammar, block)
    return scores


def _first_token(scores: TargetScores, sequence: Sequence) -> int:
    scores = _adjusted(scores, sequence)
    if sequence.sampling.greedy:
        return int(scores.argmax()[-1])
    return int(sample_from(scores.probs(sequence.sampling)[-1], sequence.generator))
