"""The one speculative step every driver runs: draft -> verify in one target forward -> accept -> commit.

    prefill_step:  the prompt enters the target's cache; its first token; the drafter starts.
    decode_step:   each sequence drafts (a chain, cut to the width its policy chooses, or a token
                   tree); ONE target forward verifies every sequence's block; the verifier accepts
                   a prefix (or a tree path) and the target's next token; the target keeps the
                   accepted rows (``VerifyTarget.keep``, the rollback); the drafter commits them
                   with the target's features there.
    end_sequence:  the drafter sees the whole answer (what a drafter that copies keeps).

The single-sequence stream, the batch engine and replay differ only in the ``VerifyTarget``
they pass (one sequence's cache, many rows in one padded forward, a recorded answer). Without
a drafter a step verifies the last token alone: plain autoregressive decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.clock import wall_clock
from blockspec.decoding.forward import TargetOutput, VerifyBlock, VerifyTarget
from blockspec.decoding.sequence import Sequence, Step
from blockspec.decoding.verifier import TargetScores, Verdict, verify_chain, verify_tree
from blockspec.drafters.base import Proposal
from blockspec.drafters.tree import Tree
from blockspec.sampling import sample_from


@dataclass
class Draft:
    """One sequence's drafts for this step, as the target will verify them."""

    block: VerifyBlock
    proposal: Proposal | None = None
    #: With an adaptive width: the drafter's confidence in each verified draft (tree: each node),
    #: when drafting started and when verifying did.
    confidences: list[float] | None = None
    drafting_began: float = 0.0
    verifying_began: float = 0.0

    @property
    def tree(self) -> Tree | None:
        return self.block.tree


def prefill_step(target: VerifyTarget, sequence: Sequence) -> Step:
    """The prompt enters the target's cache; the target picks the first token; the drafter starts."""
    sampling = sequence.sampling
    sequence.generator = None if sampling.greedy else sampling.make_generator(sequence.device)
    out = target.prefill(sequence.input_ids)
    sequence.last_token = _first_token(out.scores, sequence)
    sequence.position = sequence.input_ids.shape[1]
    if sequence.drafter is not None:
        sequence.draft_state = sequence.drafter.start(sequence.input_ids, out.features)
    return sequence.record(Step([sequence.last_token], 0, 0), decode=False)


def end_sequence(sequence: Sequence) -> None:
    """The sequence will not step again (finished or cancelled): its drafter sees the answer."""
    if sequence.drafter is not None and sequence.draft_state is not None:
        sequence.drafter.finish(sequence.draft_state, list(sequence.token_ids))


def decode_step(target: VerifyTarget, sequences: list[Sequence]) -> list[Step]:
    """One step of every sequence, their blocks verified together in one target forward."""
    device = sequences[0].device
    began = wall_clock(device)
    drafts = [draft(sequence) for sequence in sequences]
    drafted = wall_clock(device)
    outputs = target.verify([d.block for d in drafts])
    verdicts = [accept(sequence, d, out) for sequence, d, out in zip(sequences, drafts, outputs)]
    target.keep([verdict.kept_rows for verdict in verdicts])
    steps = [commit(*args) for args in zip(sequences, drafts, verdicts, outputs)]
    verified = wall_clock(device)
    for sequence in sequences:  # a batch's rows wait for every row's drafts and for the one verify forward
        if sequence.drafter is not None:
            sequence.stats.draft_seconds += drafted - began
        sequence.stats.verify_seconds += verified - drafted
    return steps


def draft(sequence: Sequence) -> Draft:
    """This step's block: the last token and its drafts (none when drafting does not pay or has no room)."""
    depth = sequence.draft_depth()
    began = wall_clock(sequence.device) if sequence.width_policy is not None else 0.0
    if depth > 0 and sequence.config.tree_budget:
        return _draft_tree(sequence, depth, began)
    proposal = Proposal.empty(sequence.device)
    if depth > 0:
        proposal = sequence.drafter.propose(sequence.draft_state, sequence.last_token, depth, sequence.sampling,
                                            sequence.generator)
    result = Draft(VerifyBlock([sequence.last_token], sequence.position), proposal, drafting_began=began)
    policy = sequence.width_policy
    if policy is not None and len(proposal.tokens) > 0:
        result.verifying_began = wall_clock(sequence.device)
        confidences = proposal.confidences()
        width = policy.choose(confidences)
        sequence.widths.append(width)
        result.proposal, result.confidences = proposal.truncated(width - 1), confidences[: width - 1]
    result.block.tokens += result.proposal.tokens.tolist()
    return result


def _draft_tree(sequence: Sequence, depth: int, began: float) -> Draft:
    """The drafter's token tree (with an adaptive width: as many of its nodes as pay)."""
    config = sequence.config
    tree, confidences = sequence.drafter.draft_tree(sequence.draft_state, sequence.last_token, depth,
                                                    config.tree_budget, config.tree_top_k)
    result = Draft(VerifyBlock([sequence.last_token], sequence.position), drafting_began=began)
    policy = sequence.width_policy
    if policy is not None:
        result.verifying_began = wall_clock(sequence.device)
        result.confidences = confidences
        tree = tree.first(policy.choose_tree_size(confidences, tree.parents))
        sequence.widths.append(len(tree) + 1)
    result.block.tokens += tree.tokens
    result.block.tree = tree
    return result


def accept(sequence: Sequence, drafted: Draft, out: TargetOutput) -> Verdict:
    """The verifier's decision on one sequence's block; the width policy learns from it."""
    sampling, generator = sequence.sampling, sequence.generator
    if drafted.tree is not None:
        verdict = verify_tree(drafted.tree, out.scores, sampling, generator)
    else:
        proposal = drafted.proposal
        verdict = verify_chain(proposal.tokens, out.scores, sampling, proposal.probs, generator)
    if drafted.confidences is not None:
        _observe(sequence, drafted, verdict)
    return verdict


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
    if drafted.tree is not None:
        step = Step(new_tokens, max(drafted.tree.depths, default=0), verdict.num_accepted, num_verified=block.width)
    else:
        step = Step(new_tokens, len(drafted.proposal.tokens), verdict.num_accepted)
    return sequence.record(step, decode=True)


def _observe(sequence: Sequence, drafted: Draft, verdict: Verdict) -> None:
    policy = sequence.width_policy
    verify_seconds = wall_clock(sequence.device) - drafted.verifying_began
    draft_seconds = drafted.verifying_began - drafted.drafting_began
    if drafted.tree is not None:
        levels = drafted.tree.walked_levels(list(verdict.path), drafted.confidences)
        policy.observe_tree(levels, verify_seconds, drafted.block.width, draft_seconds)
    else:
        policy.observe(drafted.confidences, verdict.num_accepted, verify_seconds, drafted.block.width, draft_seconds)


def _first_token(scores: TargetScores, sequence: Sequence) -> int:
    if sequence.sampling.greedy:
        return int(scores.choices()[-1])
    return int(sample_from(scores.probs(sequence.sampling)[-1], sequence.generator))
