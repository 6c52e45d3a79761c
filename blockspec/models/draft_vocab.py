"""A draft vocabulary smaller than the target's (vocabulary compression), in the public drafts' layout.

A drafter that scores only K of the target's V tokens spends K/V of the LM head's time. The
draft ids 0..K-1 map to target ids through ``d2t`` (target id = draft id + d2t[draft id]), and
``t2d`` marks the target ids in the draft vocabulary ([V] bool), as the public EAGLE-3 drafts
store them and as vLLM's EAGLE-3 and DFlash loaders read them (config ``draft_vocab_size``).
Drafts stay lossless whatever the vocabulary: the target verifies every token, and a sampled
draft's q is zero outside the K rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from blockspec.errors import CheckpointError, IncompatibleDraftError


class DraftVocabulary:
    """The ``d2t`` / ``t2d`` buffers of a module (mixed into an ``nn.Module``)."""

    def register_draft_vocabulary(self, config, *, save_t2d: bool = True) -> int:
        """The d2t / t2d buffers (the identity map when the draft vocabulary is the target's); its size.
        Without ``save_t2d`` only d2t is saved (t2d follows from it: ``derive_t2d``)."""
        size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.long))
        self.register_buffer("t2d", torch.full((config.vocab_size,), size == config.vocab_size, dtype=torch.bool),
                             persistent=save_t2d)
        if not save_t2d:  # loading d2t (a checkpoint, a resumed run) must move t2d with it
            self.register_load_state_dict_post_hook(lambda module, _keys: module.derive_t2d("the loaded draft"))
        return size

    def derive_t2d(self, where) -> None:
        """t2d from d2t (a checkpoint that stores d2t only), refusing ids outside the target's vocabulary."""
        self._check_d2t_range(where)
        self._mark_target_ids(self.draft_to_target)

    @property
    def draft_to_target(self) -> torch.LongTensor:
        """Target id of each draft id, [K]."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    @property
    def target_to_draft(self) -> torch.LongTensor:
        """Draft id of each target id, -1 where the target token is not in the draft vocabulary, [V]."""
        return target_to_draft(self.t2d)

    def set_draft_vocabulary(self, target_ids: torch.LongTensor) -> None:
        """Use the given target ids (distinct) as the draft vocabulary."""
        ids = check_vocabulary(target_ids, self.t2d.numel())
        if ids.numel() != self.d2t.numel():
            raise ValueError(f"the draft vocabulary holds {self.d2t.numel()} ids, got {ids.numel()}")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel()))
        self._mark_target_ids(ids)

    def check_draft_vocabulary(self, where) -> None:
        self._check_d2t_range(where)
        ids = self.draft_to_target
        ordered = bool((ids[1:] > ids[:-1]).all()) if ids.numel() > 1 else True
        if not ordered or not bool(self.t2d[ids].all()) or int(self.t2d.sum()) != ids.numel():
            raise CheckpointError(
                f"{where}: d2t and t2d do not describe the same draft vocabulary (d2t must map draft ids "
                "to increasing target ids, and t2d must mark exactly those ids)")

    def _check_d2t_range(self, where) -> None:
        ids, size = self.draft_to_target, self.t2d.numel()
        if int(ids.min()) < 0 or int(ids.max()) >= size:
            raise CheckpointError(f"{where}: d2t maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, "
                                  f"outside the target's vocabulary 0..{size - 1}: the draft was made for another "
                                  "vocabulary")

    def _mark_target_ids(self, ids: torch.LongTensor) -> None:
        with torch.no_grad():
            self.t2d.zero_()
            self.t2d[ids] = True


def target_to_draft(t2d: torch.BoolTensor) -> torch.LongTensor:
    """Draft id of each target id from the ``t2d`` mask, -1 where it is not in the draft vocabulary."""
    index = torch.cumsum(t2d.long(), dim=0) - 1
    return torch.where(t2d, index, torch.full_like(index, -1))


def check_vocabulary(target_ids, vocab_size: int) -> torch.LongTensor:
    """Distinct target ids, sorted; a clear error for ids outside 0..vocab_size-1 or repeated ones."""
    ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise IncompatibleDraftError("a draft vocabulary needs at least one token id")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        bad = ids[(ids < 0) | (ids >= vocab_size)][:5].tolist()
        raise IncompatibleDraftError(f"the draft vocabulary names token ids {bad} outside the target's vocabulary "
                                     f"0..{vocab_size - 1}: it was made for another tokenizer")
    ids = ids.sort().values
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise IncompatibleDraftError("the draft vocabulary names some token ids twice: list each id once")
    return ids


def most_frequent(counts: Counter, size: int, always: Iterable[int] = (), fallback: Counter | None = None,
                  vocab_size: int | None = None) -> torch.LongTensor:
    """The ``size`` ids most frequent in ``counts`` (``always`` first), sorted; when ``counts`` holds
    fewer distinct ids, the most frequent of ``fallback``, then the lowest ids not yet chosen."""
    chosen = list(dict.fromkeys([*always, *(token for token, _ in counts.most_common())]))[:size]
    if len(chosen) < size and fallback:
        seen = set(chosen)
        chosen += [token for token, _ in fallback.most_common() if token not in seen][: size - len(chosen)]
    if len(chosen) < size:
        seen = set(chosen)
        limit = vocab_size if vocab_size is not None else size + len(seen)
        chosen += [token for token in range(limit) if token not in seen][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)
