"""A classic draft model: a small causal LM with the target's tokenizer drafts token by token.

The draft keeps its own KV cache. Each ``propose`` feeds the committed tokens it has not
seen plus the last token, then drafts n tokens autoregressively (n - 1 of them enter its
cache). ``commit`` crops the cache back to the tokens the target kept. At temperature > 0
the drafts are sampled from the draft's distribution under the same sampling settings as
the target, and that distribution goes to the verifier, so rejection sampling is exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from blockspec.drafters.base import Drafter, Proposal
from blockspec.errors import BlockspecError, IncompatibleDraftError
from blockspec.models.target import position_ids
from blockspec.sampling import pick_draft

# Each draft token is one sequential forward of the draft model, so long chains cost
# draft time just as acceptance falls off: 4 drafts per step (Leviathan et al. use 3 to 7).
DEFAULT_BLOCK_SIZE = 5
_SHOWN_MISMATCHES = 3


@dataclass
class DraftLMState:
    """One sequence: the tokens the target kept, and the draft's KV cache with the tokens in it."""

    cache: DynamicCache
    tokens: list[int]
    cached_tokens: list[int] = field(default_factory=list)


class DraftModelDrafter(Drafter):
    """A small LM behind the drafter protocol."""

    name = "draft"

    def __init__(self, draft_model, target_model, *, block_size: int = DEFAULT_BLOCK_SIZE,
                 sample_drafts: bool = True):
        if block_size < 1:
            raise BlockspecError(f"block_size must be >= 1, got {block_size}")
        self.device = target_model.device
        self.model = draft_model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.vocab_size = target_model.get_output_embeddings().weight.shape[0]
        self.default_block_size = block_size
        #: At temperature > 0: sample drafts from q and use full rejection sampling (True),
        #: or draft greedily and accept with probability p(draft) (False).
        self.sample_drafts = sample_drafts

    @torch.inference_mode()
    def start(self, prompt_ids, features) -> DraftLMState:
        state = DraftLMState(DynamicCache(config=self.model.config), prompt_ids[0].tolist())
        self._next_logits(state, state.tokens)  # the prefill
        return state

    @torch.inference_mode()
    def propose(self, state: DraftLMState, last_token, num_tokens, sampling, generator) -> Proposal:
        if num_tokens == 0:
            return Proposal.empty(self.device)
        sampled = not sampling.greedy and self.sample_drafts
        feed = state.tokens[len(state.cached_tokens):] + [last_token]
        drafts, probs, confidence = [], [], []
        for _ in range(num_tokens):
            token, q, p = pick_draft(self._next_logits(state, feed), sampling, generator, sampled)
            drafts.append(token)
            probs.append(q)
            confidence.append(p)
            feed = [token]
        tokens = torch.tensor(drafts, dtype=torch.long, device=self.device)
        if sampled:  # each q follows the draws before it: no confidence the width could use losslessly
            return Proposal(tokens, torch.stack(probs))
        return Proposal(tokens, confidence=torch.tensor(confidence))

    def commit(self, state: DraftLMState, tokens, features) -> None:
        verified = len(state.tokens)
        state.tokens.extend(tokens[0].tolist())
        kept = verified + _common_prefix(state.cached_tokens[verified:], state.tokens[verified:])
        if kept < len(state.cached_tokens):
            state.cache.crop(kept - len(state.cached_tokens))
            del state.cached_tokens[kept:]

    def _next_logits(self, state: DraftLMState, new_tokens: list[int]) -> torch.Tensor:
        """Feed tokens to the draft; its logits [V_target] for the token after them."""
        start = len(state.cached_tokens)
        ids = torch.tensor([new_tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, position_ids=position_ids(start, len(new_tokens), self.device),
                         cache=state.cache, use_cache=True, logits_to_keep=1)
        state.cached_tokens.extend(new_tokens)
        return _fit_vocabulary(out.logits[0, -1].float(), self.vocab_size)


def _fit_vocabulary(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits cut or padded (with -inf) to the target's logits width."""
    width = logits.shape[-1]
    if width >= vocab_size:
        return logits[..., :vocab_size]
    return torch.nn.functional.pad(logits, (0, vocab_size - width), value=float("-inf"))


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def check_compatible(draft_tokenizer, target_tokenizer, *, draft_name: str = "the draft model") -> None:
    """Refuse a draft whose token ids mean something else than the target's.

    Every token of the target (special tokens included) must have the same id in the draft's
    vocabulary; the draft may hold extra tokens (a padded or larger vocabulary).
    """
    draft_vocab = draft_tokenizer.get_vocab()
    mismatches = [(token, index, draft_vocab.get(token)) for token, index in target_tokenizer.get_vocab().items()
                  if draft_vocab.get(token) != index]
    if not mismatches:
        return
    mismatches.sort(key=lambda m: m[1])
    shown = "; ".join(f"{token!r} is id {index} in the target but "
                      f"{'missing' if other is None else f'id {other}'} in the draft"
                      for token, index, other in mismatches[:_SHOWN_MISMATCHES])
    more = f" (and {len(mismatches) - _SHOWN_MISMATCHES} more)" if len(mismatches) > _SHOWN_MISMATCHES else ""
    raise IncompatibleDraftError(
        f"{draft_name} does not share the target's tokenizer: {shown}{more}; "
        "use a draft model of the target's family and tokenizer, or prompt lookup (method ngram)"
    )


def build(name_or_path, target, *, block_size: int = DEFAULT_BLOCK_SIZE,
          sample_drafts: bool = True) -> DraftModelDrafter:
    """A draft LM (a directory or a known model name) on the target's device and dtype."""
    return DraftModelDrafter(load_draft_model(name_or_path, target), target.model, block_size=block_size,
                             sample_drafts=sample_drafts)


def load_draft_model(name_or_path, target):
    """The draft LM, checked against the target's tokenizer, on the target's device and dtype.

    A draft saved without its embeddings (they were frozen copies of the target's, as the draft LMs
    this trainer makes keep them) gets the target's: it then reads the target's vocabulary, so its
    tokenizer may be absent too.
    """
    from blockspec.models.target import load_target

    if shares_target_embeddings(name_or_path):
        draft = _load_without_embeddings(Path(name_or_path), target)
    else:
        draft = load_target(str(name_or_path), device=target.device, dtype=target.model.dtype, role="draft")
    check_compatible(draft.tokenizer, target.tokenizer, draft_name=f"the draft model {name_or_path}")
    rows = draft.model.get_input_embeddings().weight.shape[0]
    if rows < len(target.tokenizer):
        raise IncompatibleDraftError(
            f"the draft model {name_or_path} embeds {rows} tokens but the target's tokenizer has "
            f"{len(target.tokenizer)}: use a draft model with the target's full vocabulary"
        )
    return draft.model


def shares_target_embeddings(name_or_path) -> bool:
    """Whether ``name_or_path`` is a draft LM directory whose weights lack the input embeddings."""
    path = Path(str(name_or_path))
    names = _weight_names(path) if path.is_dir() else None
    return names is not None and not any(name.endswith("embed_tokens.weight") or name.endswith("wte.weight")
                                         for name in names)


def _weight_names(directory: Path) -> set[str] | None:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    single = directory / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(single, "pt") as weights:
        return set(weights.keys())


def _load_without_embeddings(directory: Path, target):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from blockspec.models.target import Target

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the embeddings it reports missing are filled below
    try:
        model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=target.model.dtype,
                                                           output_loading_info=True)
    except (OSError, ValueError) as error:
        raise BlockspecError(f"could not load the draft model from {directory}: {error}") from error
    finally:
        hf_logging.set_verbosity(verbosity)
    parameters = dict(model.named_parameters(remove_duplicate=False))  # a tied head under both names
    absent, filled = set(info["missing_keys"]), set()
    for own, theirs in ((model.get_input_embeddings(), target.model.get_input_embeddings()),
                        (model.get_output_embeddings(), target.model.get_output_embeddings())):
        names = {name for name, parameter in parameters.items() if parameter is own.weight}
        if not names & absent:
            continue  # saved (an untied head of the draft's own)
        if own.weight.shape != theirs.weight.shape:
            raise IncompatibleDraftError(
                f"the draft model {directory} was saved without embeddings, to use the target's, but its "
                f"{tuple(own.weight.shape)} embedding shape is not the target's {tuple(theirs.weight.shape)}: "
                "use it with the target it was trained for")
        with torch.no_grad():
            own.weight.copy_(theirs.weight)  # into the draft's own tensor, so a tied head stays tied
        filled |= names
    missing = [key for key in absent - filled if "rotary" not in key]
    if missing:
        raise BlockspecError(f"the draft model {directory} lacks weights besides its embeddings "
                             f"({', '.join(sorted(missing)[:3])}): re-save it whole")
    has_tokenizer = any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(directory) if has_tokenizer else target.tokenizer
    model.to(target.device).eval()
    model.requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, name=str(directory))
