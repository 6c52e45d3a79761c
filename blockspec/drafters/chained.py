"""DSpark, Domino and DFlash2 behind the drafter protocol: one DFlash backbone pass, then the block is drafted left to
right, each position given the tokens before it.

Each position's logits are the backbone's plus a bias from the tokens before it: DSpark's Markov head reads the
token just before (the anchor for the first position, then the token drafted before), Domino's GRU all of them;
DFlash2's selector rescores the position's top-k tokens given the token before.
So a chain is sampled position by position from the distribution that position really has given the drafts
before it: the q the verifier's rejection rule uses. A token tree grows by the same rule: a node's children are
scored given that node's path. DSpark's confidence head (where the draft ships one) is the greedy chain's
confidence that the adaptive width calibrates.
"""

from __future__ import annotations

import heapq

import torch

from blockspec.drafters.base import Proposal
from blockspec.drafters.dflash import DFlashDrafter, DFlashState, _block_start
from blockspec.drafters.tree import Tree
from blockspec.errors import BlockspecError
from blockspec.models.dflash.checkpoint import load_dflash_model
from blockspec.models.dflash.modules import DFlashDraftModel
from blockspec.sampling import sample_from, sampling_probs

#: The backbone's top tokens at each position that DSpark's Markov head rescores (None: every row). The bias rarely
#: lifts a token from below them (replayed tau on 100 gsm8k prompts: see benchmarks/README.md), and rescoring 64
#: rows instead of the head's thousands makes a chain step and a tree node a fraction of the cost. A sampled draft
#: draws from the rescored candidates: that is its q.
MARKOV_CANDIDATES = 64


class DSparkDrafter(DFlashDrafter):
    """A DFlash drafter whose block positions are chained by a Markov head (and scored by a confidence head)."""

    name = "dspark"
    label = "DSpark"
    chains_positions = True
    #: None: the head's bias over every row (Domino's head is always applied whole).
    markov_candidates: int | None = None

    #: The head the draft must have, for the error when it has none.
    head_needed = "Markov head (markov_rank is 0)"

    def __init__(self, model: DFlashDraftModel, target_model, **options):
        if model.method != self.name:
            raise BlockspecError(f"this draft has no {self.head_needed}: run it as a DFlash drafter (--method dflash)")
        if options.get("denoise_steps", 1) != 1:
            raise BlockspecError(f"denoise_steps is for DFlash drafters: a {self.label} draft chains its block's "
                                 "positions through its head in one pass")
        candidates = options.pop("markov_candidates", MARKOV_CANDIDATES)
        super().__init__(model, target_model, **options)
        self.confidence_head = self.model.confidence_head
        self.attach(model, candidates)

    def attach(self, model: DFlashDraftModel, candidates: int | None) -> None:
        """Keep what drafting with the draft's head needs."""
        self.markov_head = self.model.markov_head
        self.markov_candidates = candidates
        #: The bias projection's rows, as the draft keeps them (the drafter's kernels may pack the layer).
        self.markov_rows = model.markov_head.markov_w2.weight
        #: The Markov head's id of each target token (-1: outside the draft vocabulary it was trained over).
        vocabulary = self.markov_head.markov_w1.num_embeddings
        if self.draft_to_target is None:
            self.markov_ids = torch.arange(self.vocab_size, device=self.device)
        else:
            self.markov_ids = torch.full((self.vocab_size,), -1, dtype=torch.long, device=self.device)
            self.markov_ids[self.draft_to_target] = torch.arange(vocabulary, device=self.device)

    # -- one pass of the backbone ---------------------------------------------------------------------

    def _backbone(self, state: DFlashState, last_token: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's hidden states [n, D] and the backbone's logits [n, K'] over the head's rows (the sequence's own
        tokens after them)."""
        pending, start = state.pending, _block_start(state)
        hidden = self._block_hidden(state, self._block_ids([last_token], num_tokens), start, pending)
        state.pending = None
        return hidden, self._scored(hidden, self.lm_head(hidden.to(self.head_dtype)), state)

    def initial_state(self, hidden: torch.Tensor):
        """The head's state before a block's first position."""
        return self.markov_head.initial_state(1, hidden)

    def _bias(self, previous: torch.LongTensor, hidden: torch.Tensor, state, position: int):
        """The head's bias [N, its vocabulary] (None: none) at the ``position``-th predicted position for rows whose
        previous tokens are ``previous`` [N] (target ids), its next state, and what the confidence head reads."""
        return self.markov_head.step(self.markov_ids[previous], hidden, state)

    def _step(self, logits: torch.Tensor, previous: torch.LongTensor, hidden: torch.Tensor, state, position: int,
              row_ids: torch.LongTensor | None):
        """Logits [N, K'] of one position (rows ``row_ids`` of the target's vocabulary; None: all of it) for rows whose
        previous tokens are ``previous`` [N], the head's next state and what the confidence head reads; with
        ``markov_candidates``, only the backbone's top rows are rescored and the others are -inf."""
        if self.markov_candidates:
            return self._rescored(logits, previous, hidden, state)
        bias, state, embedded = self._bias(previous, hidden, state, position)
        if bias is None:
            return logits, state, embedded
        biased = logits.clone()
        biased[:, :bias.shape[-1]] += bias.float()
        return biased, state, embedded

    def _rescored(self, logits: torch.Tensor, previous: torch.LongTensor, hidden: torch.Tensor, state):
        """The backbone's top ``markov_candidates`` rows of one position [1, K'] plus their Markov bias; -inf
        elsewhere."""
        latent, state, embedded = self.markov_head.latent(self.markov_ids[previous], hidden, state)
        top = torch.topk(logits[0], min(self.markov_candidates, logits.shape[-1]))
        known = top.indices < self.markov_rows.shape[0]  # the sequence's own rows past the head's get no bias
        bias = (self.markov_rows[top.indices.clamp(max=self.markov_rows.shape[0] - 1)] @ latent[0]) * known
        scores = logits.new_full(logits.shape, float("-inf"))
        scores[0, top.indices] = top.values + bias.float()
        return scores, state, embedded

    # -- a chain ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, state: DFlashState, last_token, num_tokens, sampling, generator) -> Proposal:
        if num_tokens == 0:
            return Proposal.empty(self.device)
        hidden, base = self._backbone(state, int(last_token), num_tokens)
        row_ids = self.row_ids(state)
        sampled = not sampling.greedy and self.sample_drafts
        tokens, probs, confidences, _ = self._chain(hidden, base, int(last_token), row_ids,
                                                    sampling if sampled else None, generator)
        if not sampled:
            return Proposal(tokens, confidence=confidences)
        # a sampled draft's confidence must not depend on its draws: the backbone's own peak at each position
        return Proposal(tokens, self._target_probs(probs, row_ids),
                        confidence=torch.softmax(base, dim=-1).amax(dim=-1))

    def _chain(self, hidden, base, last_token: int, row_ids, sampling, generator):
        """Draft the positions one after another (greedily when ``sampling`` is None): target ids [n], q [n, K'] (None
        when greedy), confidences [n] (None when sampled), and each position's logits [n, K'] given the drafts
        before it."""
        previous = torch.tensor([last_token], device=self.device)
        markov_state = self.initial_state(hidden)
        tokens, probs, confidences, rows = [], [], [], []
        for position in range(base.shape[0]):
            logits, markov_state, embedded = self._step(base[position:position + 1], previous,
                                                        hidden[position:position + 1], markov_state, position, row_ids)
            if sampling is None:
                row = logits.argmax(dim=-1)
                confidences.append(self._confidence(logits, row, hidden[position:position + 1], embedded))
            else:
                q = sampling_probs(logits, sampling)
                row = sample_from(q, generator)
                probs.append(q)
            previous = self._target_ids(row, row_ids)
            tokens.append(previous)
            rows.append(logits)
        confidence = torch.cat(confidences) if confidences else None
        return torch.cat(tokens), torch.cat(probs) if probs else None, confidence, torch.cat(rows)

    def _confidence(self, logits, row, hidden, embedded) -> torch.Tensor:
        """The chance the draft is accepted: the confidence head's where the draft ships one, else its probability."""
        if self.confidence_head is not None:
            return self.confidence_head(hidden, embedded)
        return torch.softmax(logits, dim=-1).gather(-1, row.unsqueeze(-1)).squeeze(-1)

    @torch.inference_mode()
    def row_logits(self, state: DFlashState, last_token: int, num_tokens: int):
        """Logits [n, K'] of the greedy chain's positions, each given the drafts before it."""
        hidden, base = self._backbone(state, int(last_token), num_tokens)
        row_ids = self.row_ids(state)
        return self._chain(hidden, base, int(last_token), row_ids, None, None)[3], row_ids

    def rows_logits(self, states, last_tokens, num_tokens):
        return [self.row_logits(state, token, num_tokens) for state, token in zip(states, last_tokens)]

    # -- a tree -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def draft_tree(self, state: DFlashState, last_token: int, depth: int, budget: int,
                   top_k: int) -> tuple[Tree, list[float]]:
        hidden, base = self._backbone(state, int(last_token), depth)
        return self._tree(hidden, base, int(last_token), self.row_ids(state), budget, top_k)

    @torch.inference_mode()
    def draft_trees(self, states, last_tokens, depth: int, budget: int, top_k: int):
        if len(states) == 1 or not self.model.attends_rows_alike:
            return super().draft_trees(states, last_tokens, depth, budget, top_k)
        hidden = self.rows_hidden(states, last_tokens, depth)
        heads = self.lm_head(hidden.reshape(-1, hidden.shape[-1]).to(self.head_dtype)).view(len(states), depth, -1)
        return [self._tree(hidden[row], self._scored(hidden[row], heads[row], state), int(token),
                           self.row_ids(state), budget, top_k)
                for row, (state, token) in enumerate(zip(states, last_tokens))]

    def _tree(self, hidden, base, last_token: int, row_ids, budget: int, top_k: int) -> tuple[Tree, list[float]]:
        """The ``budget`` nodes of highest joint probability, each node's children scored given that node."""
        if budget < 1:
            raise BlockspecError(f"tree budget must be >= 1, got {budget}")
        depth = base.shape[0]
        tokens, parents, depths, confidences = [], [], [], []
        frontier, counter = [], 0

        def expand(node: int, token: int, level: int, path_probability: float, markov_state):
            """Score the children of ``node`` (a target token at depth ``level``) and put them in the frontier."""
            nonlocal counter
            logits, child_state, _ = self._step(base[level:level + 1], torch.tensor([token], device=self.device),
                                                hidden[level:level + 1], markov_state, level, row_ids)
            probs = torch.softmax(logits[0], dim=-1)
            top = torch.topk(probs, min(top_k, probs.shape[-1]))
            for probability, row in zip(top.values.tolist(), top.indices.tolist()):
                counter += 1
                heapq.heappush(frontier, (-path_probability * probability, counter, node, level, row, probability,
                                          child_state))

        expand(-1, last_token, 0, 1.0, self.initial_state(hidden))
        while frontier and len(tokens) < budget:
            negative, _, parent, level, row, probability, markov_state = heapq.heappop(frontier)
            token = int(self._target_ids(torch.tensor([row], device=self.device), row_ids)[0])
            tokens.append(token)
            parents.append(parent)
            depths.append(level + 1)
            confidences.append(probability)
            if level + 1 < depth:
                expand(len(tokens) - 1, token, level + 1, -negative, markov_state)
        return Tree(tokens, parents, depths), confidences


class DominoDrafter(DSparkDrafter):
    """A DFlash drafter whose block positions Domino's GRU head chains (no confidence head: a draft's probability
    is its confidence)."""

    name = "domino"
    label = "Domino"
    head_needed = "Domino head (dflash_config.projector_type 'domino')"

    def attach(self, model: DFlashDraftModel, candidates: int | None) -> None:
        self.domino_head = self.model.domino_head

    def initial_state(self, hidden: torch.Tensor):
        return self.domino_head.initial_state(1, hidden)

    def _bias(self, previous: torch.LongTensor, hidden: torch.Tensor, state, position: int):
        bias, state = self.domino_head.step(self.embed_tokens(previous), hidden, state, position)
        if bias is not None and self.draft_to_target is not None:  # the correction is over the target's vocabulary
            bias = bias[:, self.draft_to_target]
        return bias, state, None


class DFlash2Drafter(DSparkDrafter):
    """A DFlash2 drafter: its selector walks each position's top-k candidates, each scored given the token before it
    (the draft's probability among them is its confidence)."""

    name = "dflash2"
    label = "DFlash2"
    head_needed = "candidate selector (dflash_config.selector_rank)"

    def attach(self, model: DFlashDraftModel, candidates: int | None) -> None:
        self.selector = self.model.candidate_selector

    def initial_state(self, hidden: torch.Tensor):
        return None

    def _step(self, logits: torch.Tensor, previous: torch.LongTensor, hidden: torch.Tensor, state, position: int,
              row_ids: torch.LongTensor | None):
        """The position's top-k candidates (by the backbone's logits [1, K']) rescored given the token before them;
        every other row -inf."""
        top = torch.topk(logits, min(self.selector.top_k, logits.shape[-1]), dim=-1)
        scores = top.values + self.selector.edges(previous, hidden, self._target_ids(top.indices, row_ids)).float()
        return logits.new_full(logits.shape, float("-inf")).scatter_(-1, top.indices, scores), state, None


def build(directory, target, *, sample_drafts: bool = True, packed: bool = False, draft_vocabulary=None,
          sequence_tokens: bool = True, denoise_steps: int = 1,
          markov_candidates: int | None = MARKOV_CANDIDATES) -> DSparkDrafter:
    """A DSpark drafter for ``target`` (a ``Target``) from its checkpoint directory (DeepSpec's, SpecForge's or
    vLLM speculators' layout); ``markov_candidates``: the backbone's top rows its Markov head rescores at each
    position (None: all)."""
    return DSparkDrafter(load_dflash_model(directory), target.model, sample_drafts=sample_drafts,
                         denoise_steps=denoise_steps, packed=packed, draft_vocabulary=draft_vocabulary,
                         sequence_tokens=sequence_tokens, draft_dtype="auto" if packed else None,
                         markov_candidates=markov_candidates)


def build_domino(directory, target, *, sample_drafts: bool = True, packed: bool = False, draft_vocabulary=None,
                 sequence_tokens: bool = True, denoise_steps: int = 1) -> DominoDrafter:
    """A Domino drafter for ``target`` (a ``Target``) from its checkpoint directory (SpecForge's layout)."""
    return DominoDrafter(load_dflash_model(directory), target.model, sample_drafts=sample_drafts,
                         denoise_steps=denoise_steps, packed=packed, draft_vocabulary=draft_vocabulary,
                         sequence_tokens=sequence_tokens, draft_dtype="auto" if packed else None)


def build_dflash2(directory, target, *, sample_drafts: bool = True, packed: bool = False, draft_vocabulary=None,
                  sequence_tokens: bool = True, denoise_steps: int = 1) -> DFlash2Drafter:
    """A DFlash2 drafter for ``target`` (a ``Target``) from its checkpoint directory (z-lab's or speculators'
    layout)."""
    return DFlash2Drafter(load_dflash_model(directory), target.model, sample_drafts=sample_drafts,
                          denoise_steps=denoise_steps, packed=packed, draft_vocabulary=draft_vocabulary,
                          sequence_tokens=sequence_tokens, draft_dtype="auto" if packed else None)
