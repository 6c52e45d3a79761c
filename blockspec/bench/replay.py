"""Replay greedy speculative decoding against a recorded greedy answer: exact tau, no timing.

Greedy verification accepts a draft token exactly when it equals the target's greedy token
at that place, and the target's greedy continuation is already known: it is the recorded
answer (``ar``'s tokens in a greedy ``blockspec bench`` run). So the target runs ONCE over
prompt + answer (its features for every position), and the drafter then drafts step by
step as in the loop (``begin``, ``propose``, ``commit`` with the same tokens and features),
each draft checked against the answer. The acceptance lengths are those of the live loop
(up to float noise between one long forward and many short ones), at a fraction of the
cost: no verify forwards, and one drafter can be replayed at many widths and tree budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.sampling import SamplingConfig
from blockspec.decoding.tree import DEFAULT_TREE_TOP_K, build_tree
from blockspec.errors import BlockspecError

GREEDY = SamplingConfig()


@torch.inference_mode()
def replay_acceptance(target_model, drafter, prompt_ids: list[int], answer_ids: list[int], *,
                      max_new_tokens: int | None = None, block_size: int | None = None,
                      tree_budget: int | None = None, tree_top_k: int = DEFAULT_TREE_TOP_K) -> list[int]:
    """Tokens each decode step would produce (accepted drafts + 1) decoding ``answer_ids`` greedily.

    ``answer_ids`` must be the target's greedy answer to ``prompt_ids`` (its first token is the
    prefill's) under ``max_new_tokens`` (default: its length; an answer that stopped earlier
    ends on a stop token). ``block_size``: the verify width (default: the drafter's);
    ``tree_budget``: verify a token tree of that many nodes instead (drafters with
    ``draft_logits``, i.e. DFlash).
    """
    if len(answer_ids) < 1:
        raise BlockspecError("replay needs a recorded answer of at least one token")
    max_new_tokens = max_new_tokens or len(answer_ids)
    if max_new_tokens < len(answer_ids):
        raise BlockspecError(f"the answer has {len(answer_ids)} tokens, more than max_new_tokens={max_new_tokens}")
    if tree_budget and not hasattr(drafter, "draft_logits"):
        raise BlockspecError(f"tree replay needs a one-pass drafter (dflash), not {drafter.name}")
    width = block_size or drafter.default_block_size
    if drafter.max_draft_tokens is not None and width - 1 > drafter.max_draft_tokens:
        raise BlockspecError(f"block size {width} is above what {drafter.name} drafts "
                             f"({drafter.max_draft_tokens + 1})")
    device = target_model.device
    sequence = torch.tensor([list(prompt_ids) + list(answer_ids)], device=device)
    features = _features(target_model, drafter, sequence)
    start = len(prompt_ids)
    drafter.begin(sequence[:, :start], None if features is None else features[:, :start])
    lengths = []
    position = start  # the answer token the target has just produced; drafts follow it
    end = sequence.shape[1]
    while position < end - 1:
        produced = position - start + 1
        depth = min(width - 1, max_new_tokens - produced - 1)  # as the loop: room for the target's own token
        truth = sequence[0, position + 1: position + 1 + depth].tolist()
        accepted = _accepted(drafter, int(sequence[0, position]), depth, truth, tree_budget, tree_top_k)
        kept = min(accepted + 1, end - 1 - position)  # the loop cuts a step at the answer's stop token
        drafter.commit(sequence[:, position:position + kept],
                       None if features is None else features[:, position:position + kept])
        lengths.append(kept)
        position += kept
    return lengths


def _features(target_model, drafter, sequence):
    if drafter.feature_layers is None:
        return None
    out = target_model(input_ids=sequence, output_hidden_states=True, logits_to_keep=1)
    return torch.cat([out.hidden_states[i + 1] for i in drafter.feature_layers], dim=-1)


def _accepted(drafter, last_token: int, depth: int, truth: list[int], tree_budget, tree_top_k) -> int:
    """How many of ``depth`` drafts after ``last_token`` greedy verification keeps, ``truth`` being the
    target's next tokens (it may be shorter than ``depth`` where the answer ends)."""
    if depth <= 0:
        return 0
    if tree_budget:
        probs = torch.softmax(drafter.draft_logits(last_token, depth).float(), dim=-1)
        tree = build_tree(probs, tree_budget, tree_top_k)
        node, accepted = -1, 0
        while accepted < len(truth):
            node = next((c for c in tree.children(node) if tree.tokens[c] == truth[accepted]), None)
            if node is None:
                break
            accepted += 1
        return accepted
    drafts = drafter.propose(last_token, depth, GREEDY, None).tokens.tolist()
    accepted = 0
    while accepted < min(len(drafts), len(truth)) and drafts[accepted] == truth[accepted]:
        accepted += 1
    return accepted


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
    from blockspec.bench.cli import load_prompts

    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    return {row["id"]: row for row in load_prompts(datasets, data_dir, None, None)}


def _rebuild_prompt(target, rows: dict, record: dict, config: dict) -> list[int]:
    from blockspec.bench.runner import encode_history

    row = rows.get(record["id"])
    if row is None:
        raise BlockspecError(f"prompt {record['id']} of the results is not in the data source: pass the --data-dir "
                             "the bench read")
    first_turn = [{"role": "user", "content": row["turns"][0]}]
    prompt = encode_history(target, first_turn, config.get("use_chat_template", True))
    if len(prompt) != record["prompt_tokens"][0]:
        raise BlockspecError(f"prompt {record['id']} rebuilds to {len(prompt)} tokens, the run had "
                             f"{record['prompt_tokens'][0]}: another data source, tokenizer or chat template")
    return prompt
