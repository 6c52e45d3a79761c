"""Log-probabilities come from the target's verify forward: each output token's, at the row that predicted it,
the same whether the token was drafted and accepted, recovered, or decoded alone."""

import pytest
import torch

from blockspec.decoding.batch import batch_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.errors import BlockspecError
from helpers import MAX_NEW, NoisyOracle, decode, make_causal_lm, make_dflash, prompts, repetitive_prompts


@pytest.fixture(scope="module")
def world():
    target = make_causal_lm("qwen3", vocab_size=320, seed=4)
    return target, DFlashDrafter(make_dflash(target, block_size=8), target, sample_drafts=False)


def teacher_forced(target, ids, output, top):
    """Each output token's log-probability from one forward over the prompt and the whole output."""
    with torch.no_grad():
        logits = target(torch.cat([ids, torch.tensor([output])], dim=1)).logits[0]
    rows = torch.log_softmax(logits[ids.shape[1] - 1:-1].float(), dim=-1)
    return rows[torch.arange(len(output)), torch.tensor(output)], rows.topk(top, dim=-1)


@pytest.mark.parametrize("top", [0, 3])
def test_logprobs_are_the_targets_at_every_token_however_it_was_decoded(world, top):
    target, dflash = world
    accepted = 0
    for ids in repetitive_prompts(320, 3, seed=2) + prompts(320, count=2, seed=3):
        plain = decode(target, ids, None, GenerationConfig(max_new_tokens=MAX_NEW, logprobs=top))
        chosen, best = teacher_forced(target, ids, plain.token_ids, max(top, 1))
        oracle = NoisyOracle(ids[0].tolist() + plain.token_ids, 320)
        for drafter, shape in [(None, {}), (dflash, {"block_size": 8}), (oracle, {"block_size": 8}),
                               (oracle, {"block_size": 8, "tree_budget": 6})]:
            stream = decode(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW, logprobs=top, **shape))
            logprobs = stream.sequence.logprobs
            assert stream.token_ids == plain.token_ids
            assert [lp.token for lp in logprobs] == plain.token_ids
            assert torch.allclose(torch.tensor([lp.logprob for lp in logprobs]), chosen, atol=1e-4)
            if top:
                assert [[t for t, _ in lp.top] for lp in logprobs] == best.indices.tolist()
                assert torch.allclose(torch.tensor([[v for _, v in lp.top] for lp in logprobs]), best.values,
                                      atol=1e-4)
            else:
                assert all(lp.top == () for lp in logprobs)
            accepted += sum(stream.stats.accepted)
    assert accepted > 50


def test_a_batchs_rows_carry_their_own_logprobs(world):
    target, dflash = world
    ids = repetitive_prompts(320, 3, seed=4)
    results = batch_generate(target, ids, dflash, GenerationConfig(max_new_tokens=MAX_NEW, block_size=6, logprobs=2),
                             max_batch_size=3)
    for row, result in zip(ids, results):
        assert result.token_ids == decode(target, row, None, GenerationConfig(max_new_tokens=MAX_NEW)).token_ids
        chosen, _ = teacher_forced(target, row, result.token_ids, 2)
        steps = [lp for step in result.stats.steps for lp in step.logprobs]
        assert len(steps) == len(result.token_ids) - 1  # the prefill's token is not a decode step's
        assert torch.allclose(torch.tensor([lp.logprob for lp in steps]), chosen[1:], atol=1e-4)


def test_no_logprobs_unless_asked_and_a_bound_on_how_many(world):
    target, _ = world
    stream = decode(target, prompts(320, count=1)[0], None, GenerationConfig(max_new_tokens=4))
    assert stream.sequence.logprobs == [] and all(step.logprobs is None for step in stream.stats.steps)
    with pytest.raises(BlockspecError, match="logprobs must be between 0 and 20"):
        GenerationConfig(logprobs=21)
