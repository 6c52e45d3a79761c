"""Replay greedy speculative decoding against a recorded greedy answer: exact tau, no timing.

Greedy verification accepts a draft token exactly when it equals the target's greedy token
at that place, and the target's greedy continuation is already known: it is the recorded
answer (``ar``'s tokens in a greedy ``blockspec bench`` run). So the target runs ONCE over
prompt + answer (its features for every position), and the decoding step then runs as in the
live loop, its verify forwards answered from the recording (``RecordedTarget``). The
acceptance lengths are those of the live loop (up to float noise between one long forward
and many short ones), at a fraction of the cost: no verify forwards, and one drafter can be
replayed at many widths and tree budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.decoding.block import VerifyBlock
from blockspec.decoding.forward import TargetOutput
from blockspec.decoding.sequence import GenerationConfig, new_sequence
from blockspec.decoding.step import decode_step, end_sequence, prefill_step
from blockspec.decoding.verifier import TargetScores
from blockspec.drafters.base import TreeDrafter
from blockspec.drafters.tree import DEFAULT_TREE_TOP_K
from blockspec.errors import BlockspecError
from blockspec.models.target import layer_features
from blockspec.tokens import encode_prompt

#: Stands for "no token" where a verified row lies past the end of the recorded answer.
_PAST_THE_ANSWER = -1


class RecordedTarget:
    """A ``VerifyTarget`` whose greedy choices are the recorded answer and whose features come
    from one forward over prompt + answer."""

    def __init__(self, sequence: torch.LongTensor, features: torch.Tensor | None):
        self.tokens = sequence[0]
        self.features = features

    def prefill(self, input_ids) -> TargetOutput:
        length = input_ids.shape[1]
        return TargetOutput(TargetScores(greedy_tokens=self.tokens[length:length + 1]), self._features(range(length)))

    def verify(self, blocks: list[VerifyBlock]) -> list[TargetOutput]:
        return [self._verify(block) for block in blocks]

    def keep(self, kept_rows) -> None:
        pass  # nothing is cached: every verify reads the recording

    def _verify(self, block: VerifyBlock) -> TargetOutput:
        # Row i sits at depth d (a chain's row i at depth i): if every draft on its path is accepted,
        # the target's greedy token there is the answer's token at start + d + 1. Rows off that path
        # are never read by the verifier.
        depths = block.depths
        end = self.tokens.shape[0]
        choices = [int(self.tokens[block.start + d + 1]) if block.start + d + 1 < end else _PAST_THE_ANSWER
                   for d in depths]
        positions = [min(block.start + d, end - 1) for d in depths]
        return TargetOutput(TargetScores(greedy_tokens=torch.tensor(choices)), self._features(positions))

    def _features(self, positions) -> torch.Tensor | None:
        return None if self.features is None else self.features[:, list(positions)]


@torch.inference_mode()
def replay_acceptance(target_model, drafter, prompt_ids: list[int], answer_ids: list[int], *,
                      max_new_tokens: int | None = None, block_size: int | None = None,
                      tree_budget: int | None = None, tree_top_k: int = DEFAULT_TREE_TOP_K) -> list[int]:
    """Tokens each decode step would produce (accepted drafts + 1) decoding ``answer_ids`` greedily.

    ``answer_ids`` must be the target's greedy answer to ``prompt_ids`` (its first token is the
    prefill's) under ``max_new_tokens`` (default: its length; an answer that stopped earlier
    ends on a stop token). ``block_size``: the verify width (default: the drafter's);
    ``tree_budget``: verify a token tree of that many nodes instead (tree drafters, i.e. DFlash).
    """
    if len(answer_ids) < 1:
        raise BlockspecError("replay needs a recorded answer of at least one token")
    max_new_tokens = max_new_tokens or len(answer_ids)
    if max_new_tokens < len(answer_ids):
        raise BlockspecError(f"the answer has {len(answer_ids)} tokens, more than max_new_tokens={max_new_tokens}")
    if tree_budget and not isinstance(drafter, TreeDrafter):
        raise BlockspecError(f"tree replay needs a drafter that proposes token trees, not {drafter.name}")
    width = block_size or drafter.default_block_size
    if drafter.max_draft_tokens is not None and width - 1 > drafter.max_draft_tokens:
        raise BlockspecError(f"block size {width} is above what {drafter.name} drafts "
                             f"({drafter.max_draft_tokens + 1})")
    # an answer shorter than the limit stopped on its last token: the loop ends a step there
    stops = (answer_ids[-1],) if len(answer_ids) < max_new_tokens else ()
    config = GenerationConfig(max_new_tokens=max_new_tokens, block_size=width, stop_token_ids=stops,
                              tree_budget=tree_budget, tree_top_k=tree_top_k)
    sequence_ids = torch.tensor([list(prompt_ids) + list(answer_ids)], device=target_model.device)
    target = RecordedTarget(sequence_ids, _features(target_model, drafter, sequence_ids))
    sequence = new_sequence(target_model, sequence_ids[:, :len(prompt_ids)], drafter, config)
    prefill_step(target, sequence)
    while not sequence.finished:
        decode_step(target, [sequence])
    end_sequence(sequence)
    return sequence.stats.acceptance_lengths


def _features(target_model, drafter, sequence):
    if drafter.feature_layers is None:
        return None
    out = target_model(input_ids=sequence, output_hidden_states=True, logits_to_keep=1)
    return layer_features(out.hidden_states, drafter.feature_layers)


@dataclass
class RecordedAnswer:
    dataset: str
    id: str
    prompt_ids: list[int]
    answer_ids: list[int]


def recorded_answers(results: dict, target, data_dir=None) -> list[RecordedAnswer]:
    """The first-turn prompts and ``ar`` answers of a greedy ``blockspec bench`` results.json.

    Runs that predate ``prompt_ids`` in the records get their prompts rebuilt from ``data_dir``
    (as the bench read them), checked against the recorded prompt lengths.
    """
    config = results.get("config", {})
    if config.get("temperature", 0) != 0:
        raise BlockspecError("replay needs a greedy run (temperature 0): a sampled answer is not the target's "
                             "greedy continuation")
    records = [r for r in results.get("records", []) if r.get("method") == "ar"]
    if not records:
        raise BlockspecError("the results hold no 'ar' records to replay against")
    rows = None
    answers = []
    for record in records:
        prompt = (record.get("prompt_ids") or [None])[0]
        if prompt is None:
            rows = rows if rows is not None else _rows_by_id(records, data_dir)
            prompt = _rebuild_prompt(target, rows, record, config)
        answers.append(RecordedAnswer(record["dataset"], record["id"], list(prompt), list(record["token_ids"][0])))
    return answers


def _rows_by_id(records, data_dir) -> dict:
    from blockspec.bench.setup import load_prompts

    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    return {row["id"]: row for row in load_prompts(datasets, data_dir, None, None)}


def _rebuild_prompt(target, rows: dict, record: dict, config: dict) -> list[int]:
    row = rows.get(record["id"])
    if row is None:
        raise BlockspecError(f"prompt {record['id']} of the results is not in the data source: pass the --data-dir "
                             "the bench read")
    first_turn = [{"role": "user", "content": row["turns"][0]}]
    prompt = encode_prompt(target.tokenizer, first_turn, use_chat_template=config.get("use_chat_template", True))
    if len(prompt) != record["prompt_tokens"][0]:
        raise BlockspecError(f"prompt {record['id']} rebuilds to {len(prompt)} tokens, the run had "
                             f"{record['prompt_tokens'][0]}: another data source, tokenizer or chat template")
    return prompt
