"""Greedy speculative decoding must reproduce plain greedy decoding token for token."""

import pytest
import torch

from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.base import Drafter, Proposal
from blockspec.drafters.dflash import DFlashDrafter
from helpers import MAX_NEW, TWO_FAMILIES, hf_greedy, make_causal_lm, make_dflash, prompts


@pytest.fixture(scope="module", params=TWO_FAMILIES)
def target_and_references(request):
    # float64 so that the block-wise verify and HF's token-by-token decode cannot
    # disagree through rounding; the fp32 case is covered separately below.
    target = make_causal_lm(request.param, vocab_size=320).double()
    references = [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in prompts(320)]
    return target, references


@pytest.mark.parametrize("block_size", [pytest.param(2, marks=pytest.mark.slow), 4,
                                        pytest.param(8, marks=pytest.mark.slow), 16])
def test_dflash_greedy_equals_hf_generate(target_and_references, block_size):
    target, references = target_and_references
    drafter = DFlashDrafter(make_dflash(target, block_size=16), target)
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size)
    for ids, expected in references:
        stream = speculative_generate(target, ids, drafter, config)
        list(stream)
        assert stream.token_ids == expected
        assert stream.stats.new_tokens == MAX_NEW
        assert all(1 <= n <= block_size for n in stream.stats.acceptance_lengths)


def test_ar_mode_equals_hf_generate(target_and_references):
    target, references = target_and_references
    for ids, expected in references[:10]:
        stream = speculative_generate(target, ids, None, GenerationConfig(max_new_tokens=MAX_NEW))
        list(stream)
        assert stream.token_ids == expected
        assert stream.stats.tau == 1.0


def test_fp32_greedy_equals_hf_generate():
    target = make_causal_lm("qwen3", vocab_size=320, seed=3)
    drafter = DFlashDrafter(make_dflash(target), target)
    for ids in prompts(320, count=10, seed=5):
        stream = speculative_generate(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW))
        list(stream)
        assert stream.token_ids == hf_greedy(target, ids, MAX_NEW)


def test_stop_token_ends_generation_like_hf():
    target = make_causal_lm("llama", vocab_size=320, seed=4).double()
    drafter = DFlashDrafter(make_dflash(target), target)
    stopped = 0
    for ids in prompts(320, count=20, seed=7):
        free_run = hf_greedy(target, ids, MAX_NEW)
        eos = free_run[len(free_run) // 2]  # a token that does occur, to force a stop mid-block
        expected = hf_greedy(target, ids, MAX_NEW, eos=eos)
        config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=8, stop_token_ids=(eos,))
        stream = speculative_generate(target, ids, drafter, config)
        list(stream)
        assert stream.token_ids == expected
        stopped += stream.stats.finish_reason == "stop"
    assert stopped == 20


class OracleDrafter(Drafter):
    """Proposes the target's own greedy continuation: every draft must be accepted."""

    name = "oracle"

    def __init__(self, reference: list[int], block_size: int):
        self.reference = reference
        self.default_block_size = block_size

    def start(self, prompt_ids, features):
        return {"position": prompt_ids.shape[1]}

    def propose(self, state, last_token, num_tokens, sampling, generator):
        assert self.reference[state["position"]] == last_token
        start = state["position"] + 1
        return Proposal(torch.tensor(self.reference[start:start + num_tokens]))

    def commit(self, state, tokens, features):
        state["position"] += tokens.shape[1]


@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_perfect_drafter_reaches_tau_equal_block_size(target_and_references, block_size):
    target, references = target_and_references
    for ids, expected in references[:10]:
        drafter = OracleDrafter(ids[0].tolist() + expected, block_size)
        stream = speculative_generate(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW))
        list(stream)
        assert stream.token_ids == expected
        lengths = stream.stats.acceptance_lengths
        assert all(n == block_size for n in lengths[:-1]), lengths
        assert lengths[-1] == (MAX_NEW - 1) - block_size * (len(lengths) - 1)
        assert stream.stats.acceptance_by_position() == [1.0] * (block_size - 1)


def test_streamed_steps_add_up_to_the_output(target_and_references):
    target, references = target_and_references
    ids, expected = references[0]
    drafter = DFlashDrafter(make_dflash(target), target)
    stream = speculative_generate(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW, block_size=4))
    pieces = [step.tokens for step in stream]
    assert sum(pieces, []) == expected
    assert len(pieces) == stream.stats.target_forwards
