"""Bad input gets a clear error that names the fix."""

import pytest
import torch

from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.errors import BlockspecError, IncompatibleDraftError
from helpers import make_causal_lm, make_dflash


@pytest.fixture(scope="module")
def target():
    return make_causal_lm("llama")


@pytest.mark.parametrize("change,message", [
    (dict(hidden_size=32, head_dim=8), "hidden size 32 but the target has 64"),
    (dict(vocab_size=300), "vocabulary 300 but the target has 320"),
    (dict(num_hidden_layers=6), "target of 6 layers but the target has 4"),
])
def test_draft_for_another_target_is_refused(target, change, message):
    other = make_causal_lm("llama", **change)
    draft = make_dflash(other)
    with pytest.raises(IncompatibleDraftError, match=message):
        DFlashDrafter(draft, target)


def test_mask_token_outside_the_vocabulary_is_refused(target):
    with pytest.raises(IncompatibleDraftError, match="mask_token_id 999"):
        DFlashDrafter(make_dflash(target, mask_token_id=999), target)


@pytest.mark.parametrize("options,message", [
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
])
def test_bad_generation_options(options, message):
    with pytest.raises(BlockspecError, match=message):
        GenerationConfig(**options)


def test_block_size_above_the_trained_size(target):
    drafter = DFlashDrafter(make_dflash(target, block_size=8), target)
    with pytest.raises(BlockspecError, match="above the dflash drafter's trained block size 8"):
        speculative_generate(target, [5, 6], drafter, GenerationConfig(block_size=9))


def test_block_size_can_be_lowered(target):
    drafter = DFlashDrafter(make_dflash(target, block_size=8), target)
    stream = speculative_generate(target, [5, 6], drafter, GenerationConfig(block_size=3, max_new_tokens=9))
    list(stream)
    assert max(stream.stats.drafted) == 2


def test_empty_prompt(target):
    with pytest.raises(BlockspecError, match="prompt is empty"):
        speculative_generate(target, [], None, GenerationConfig())


def test_prompt_longer_than_the_context(target):
    too_long = torch.full((1, 600), 5)
    with pytest.raises(BlockspecError, match="600 tokens but the model's context is 512"):
        speculative_generate(target, too_long, None, GenerationConfig())


def test_generation_stops_at_the_context_end(target):
    stream = speculative_generate(target, torch.full((1, 500), 5), None, GenerationConfig(max_new_tokens=50))
    list(stream)
    assert stream.stats.new_tokens == 12 and stream.stats.finish_reason == "context"
