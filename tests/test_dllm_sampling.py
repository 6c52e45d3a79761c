"""Masked-diffusion samplers: schedules, scores, caches, stops and batching."""

from __future__ import annotations

import math

import pytest
import torch

from blockspec.dllm.generate import DiffusionConfig, candidate_tokens, diffusion_generate
from blockspec.dllm.model import BLOCK_CAUSAL
from blockspec.dllm.schedule import Scheduler, linear_counts, select_positions, token_scores
from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingConfig
from helpers import DLLM_MASK, tiny_dllm

MASK = DLLM_MASK
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]


def run(model, prompts=PROMPTS, eos=(), **settings):
    stream = diffusion_generate(model, prompts, DiffusionConfig(**settings), eos_token_ids=eos)
    steps = list(stream)
    return stream, steps


class LogitsSpy:
    """Wraps a model and keeps every logits tensor the sampler was given."""

    def __init__(self, model):
        self.inner, self.seen = model, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def logits(self, *args, **kwargs):
        out = self.inner.logits(*args, **kwargs)
        self.seen.append(out)
        return out


# --- the scheduler's parts ---------------------------------------------------------------

def test_linear_counts_spread_the_masks_evenly():
    counts = linear_counts(torch.tensor([10, 3, 0]), 4)
    assert counts.tolist() == [[3, 3, 2, 2], [1, 1, 1, 0], [0, 0, 0, 0]]


def test_scores_rank_as_the_papers_define_them():
    probs = torch.tensor([[[0.9, 0.05, 0.05], [0.5, 0.49, 0.01], [1 / 3, 1 / 3, 1 / 3]]])
    tokens = torch.tensor([[0, 1, 2]])
    assert token_scores(probs, tokens, "confidence")[0].tolist() == pytest.approx([0.9, 0.49, 1 / 3])
    assert token_scores(probs, tokens, "margin")[0].tolist() == pytest.approx([0.85, 0.01, 0.0], abs=1e-6)
    entropy = token_scores(probs, tokens, "entropy")[0]
    assert entropy[2] == pytest.approx(-math.log(3), abs=1e-5)
    assert entropy[0] > entropy[1] > entropy[2]


def test_selection_takes_the_best_masked_positions_per_row():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.7], [0.2, 0.8, 0.3, 0.4]])
    masked = torch.tensor([[False, True, True, True], [True, True, True, True]])
    chosen = select_positions(scores, masked, torch.tensor([2, 1]))
    assert chosen.tolist() == [[False, False, True, True], [False, True, False, False]]


def test_sampled_selection_follows_softmax_of_scores_over_temperature():
    scores = torch.tensor([[0.0, math.log(3.0)]])
    masked = torch.ones(1, 2, dtype=torch.bool)
    generator = torch.Generator().manual_seed(0)
    picks = [int(select_positions(scores, masked, torch.tensor([1]), how="sample", alg_temp=1.0,
                                  generator=generator)[0, 1]) for _ in range(4000)]
    assert sum(picks) / len(picks) == pytest.approx(0.75, abs=0.03)


def test_gumbel_max_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]])).expand(1, 6000, 3)
    tokens, probs = candidate_tokens(logits, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(1))
    frequencies = torch.bincount(tokens.flatten(), minlength=3).float() / tokens.numel()
    assert frequencies.tolist() == pytest.approx([0.5, 0.3, 0.2], abs=0.02)
    assert probs[0, 0].tolist() == pytest.approx([0.5, 0.3, 0.2], abs=1e-6)


# --- each sampler commits what its schedule says --------------------------------------------

@pytest.mark.parametrize("preset", ["llada", "dream"])
def test_linear_samplers_commit_exactly_the_scheduled_number(preset):
    model = tiny_dllm(shifted=preset == "dream")
    config = DiffusionConfig.preset(preset, gen_length=16, steps=12, block_length=8 if preset == "llada" else None)
    stream = diffusion_generate(model, PROMPTS, config)
    list(stream)
    blocks = 16 // (config.block_length or 16)
    per_block = linear_counts(torch.full((len(PROMPTS),), 16 // blocks), 12 // blocks).T.tolist()
    assert stream.stats.commits_per_step == per_block * blocks


def test_block_diffusion_commits_exactly_the_scheduled_number():
    model = tiny_dllm(attention=BLOCK_CAUSAL)
    stream, _ = run(model, gen_length=12, block_length=4, steps=9, cache="exact")
    assert stream.stats.commits_per_step == linear_counts(torch.full((3,), 4), 3).T.tolist() * 3


def test_origin_reveals_every_mask_within_the_block_steps():
    model = tiny_dllm()
    scheduler = Scheduler(count="bernoulli", score="random")
    stream, steps = run(model, gen_length=16, block_length=8, steps=8, scheduler=scheduler, seed=3)
    assert len(steps) == 8
    per_row = torch.tensor(stream.stats.commits_per_step)
    assert per_row[:4].sum(dim=0).tolist() == [8, 8, 8] and per_row[4:].sum(dim=0).tolist() == [8, 8, 8]


def test_threshold_one_commits_one_token_per_step():
    model = tiny_dllm()
    stream, steps = run(model, gen_length=8, block_length=8, cache="none",
                        scheduler=Scheduler(count="threshold", threshold=1.0))
    assert len(steps) == 8 and all(counts == [1, 1, 1] for counts in stream.stats.commits_per_step)


def test_threshold_commits_every_token_above_it_at_least_one():
    model = LogitsSpy(tiny_dllm())
    stream, steps = run(model, gen_length=8, block_length=8, scheduler=Scheduler(count="threshold", threshold=0.003))
    first = torch.softmax(model.seen[0], dim=-1).max(dim=-1).values
    expected = torch.clamp((first > 0.003).sum(dim=1), min=1)
    assert stream.stats.commits_per_step[0] == expected.tolist()
    assert sum(c[0] for c in stream.stats.commits_per_step) == 8


def test_every_step_commits_only_masked_positions_of_its_block():
    model = tiny_dllm()
    _, steps = run(model, gen_length=16, block_length=8, steps=8)
    seen = [set() for _ in PROMPTS]
    for event in steps:
        for row, positions in enumerate(event.committed):
            low = 8 * event.block
            assert all(low <= p < low + 8 and p not in seen[row] for p in positions)
            seen[row].update(positions)
    assert all(s == set(range(16)) for s in seen)


class PositionEcho:
    """A fake diffusion model whose logits at position p point at token (p + 100)."""

    mask_token_id, vocab_size, device = MASK, 320, torch.device("cpu")

    def __init__(self, shifted):
        self.shifted = shifted

    def logits(self, input_ids, *, position_ids, attention_mask, cache=None, keep=None):
        positions = position_ids if keep is None else position_ids[:, keep]
        return torch.nn.functional.one_hot(positions + 100, 320).float() * 10


# --- batching, stops ---------------------------------------------------------------------

@pytest.mark.parametrize("cache", ["none", "dual"])
def test_batched_rows_equal_their_single_runs(cache):
    model = tiny_dllm(layers=1)
    batched, _ = run(model, gen_length=8, block_length=4, steps=8, cache=cache)
    for row, prompt in enumerate(PROMPTS):
        alone, _ = run(model, prompts=[prompt], gen_length=8, block_length=4, steps=8, cache=cache)
        assert alone.token_ids[0] == batched.token_ids[row]


class EosInRowOne(PositionEcho):
    """Echoes positions, except that the row whose prompt holds token 12 says EOS (50) second."""

    def __init__(self):
        super().__init__(shifted=False)

    def logits(self, input_ids, *, position_ids, attention_mask, cache=None, keep=None):
        out = super().logits(input_ids, position_ids=position_ids, attention_mask=attention_mask, keep=keep)
        row = (input_ids == 12).any(dim=1)
        second = position_ids[:, keep] == position_ids[:, -1:] - 14  # the answer's second position
        out[row[:, None] & second] = torch.nn.functional.one_hot(torch.tensor(50), 320).float() * 10
        return out


def test_a_row_that_emits_eos_stops_while_the_others_go_on():
    stream, _ = run(EosInRowOne(), eos=(50,), gen_length=16, block_length=4, steps=16)
    assert stream.token_ids[1] == [100 + 3, 50]  # row 1's prompt has 3 tokens
    assert stream.stats.finish_reasons == ["length", "stop", "length"]
    assert [len(t) for t in stream.token_ids] == [16, 2, 16]
    later_commits = [counts[1] for counts in stream.stats.commits_per_step[4:]]
    assert len(later_commits) == 12 and all(c == 0 for c in later_commits)
    assert stream.stats.tokens == [16, 2, 16]


# --- caches ------------------------------------------------------------------------------

@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_and_uncached_block_diffusion_agree_exactly(shifted, temperature):
    outputs = []
    for cache in ("none", "exact"):
        model = LogitsSpy(tiny_dllm(shifted=shifted, attention=BLOCK_CAUSAL))
        stream, _ = run(model, gen_length=12, block_length=4, steps=12, cache=cache, temperature=temperature, seed=5)
        outputs.append((stream.token_ids, model))
    (plain_ids, _), (cached_ids, _) = outputs
    assert plain_ids == cached_ids


def test_exact_cache_logits_match_uncached_per_step():
    models = {}
    for cache in ("none", "exact"):
        model = tiny_dllm(shifted=True, attention=BLOCK_CAUSAL)
        stepped = []
        original = model.logits

        def spy(*args, _original=original, _store=stepped, **kwargs):
            out = _original(*args, **kwargs)
            _store.append(out)
            return out

        model.logits = spy
        run(model, gen_length=8, block_length=4, steps=8, cache=cache)
        models[cache] = stepped
    uncached = models["none"]
    # The exact run also feeds the prompt and each finished block once; its step logits are
    # [head ; block] for a shifted model: compare the block positions it computed itself.
    cached_steps = [out for out in models["exact"] if out.shape[1] == 3]
    assert len(cached_steps) == len(uncached)
    for plain, cached in zip(uncached, cached_steps):
        torch.testing.assert_close(cached, plain[:, 1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("shifted", [False, True])
def test_approximate_caches_are_exact_for_a_one_layer_model(cache, shifted):
    """With one layer a position's key and value depend on its own token only, so Fast-dLLM's
    caches lose nothing: a mistake in what they keep or feed shows up as a difference."""
    model = tiny_dllm(shifted=shifted, layers=1)
    plain, _ = run(model, gen_length=12, block_length=4, steps=12, cache="none")
    cached, _ = run(model, gen_length=12, block_length=4, steps=12, cache=cache)
    assert plain.token_ids == cached.token_ids


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_approximate_caches_feed_fewer_positions(cache):
    model = tiny_dllm(layers=2)
    plain, _ = run(model, gen_length=8, block_length=8, steps=8, cache="none")
    cached, _ = run(model, gen_length=8, block_length=8, steps=8, cache=cache)
    assert cached.stats.forwards == plain.stats.forwards
    assert cached.stats.fed_positions < plain.stats.fed_positions


# --- shifted logits and guidance ---------------------------------------------------------

@pytest.mark.parametrize("shifted", [False, True])
def test_shifted_models_predict_each_token_from_the_position_before_it(shifted):
    stream, _ = run(PositionEcho(shifted), prompts=[[5, 6, 7]], gen_length=4, block_length=4, steps=4)
    first_position = 3 - (1 if shifted else 0)
    assert stream.token_ids[0] == [100 + first_position + i for i in range(4)]


class Guidable:
    """Conditional logits favour token 11 a little; with the prompt masked they favour it more."""

    mask_token_id, vocab_size, device, shifted = MASK, 20, torch.device("cpu"), False

    def __init__(self):
        self.rows_seen = []

    def logits(self, input_ids, *, position_ids, attention_mask, cache=None, keep=None):
        self.rows_seen.append(input_ids.shape[0])
        prompt_masked = (input_ids[:, :2] == MASK).all(dim=1)
        out = torch.zeros(input_ids.shape[0], len(keep), 20)
        out[:, :, 10] = 2.0
        out[:, :, 11] = 2.2
        out[prompt_masked, :, 11] = 3.0
        return out


def test_classifier_free_guidance_extrapolates_away_from_the_unconditional():
    plain, _ = run(Guidable(), prompts=[[5, 6]], gen_length=2, block_length=2, steps=2)
    assert plain.token_ids[0] == [11, 11]
    model = Guidable()
    guided, _ = run(model, prompts=[[5, 6]], gen_length=2, block_length=2, steps=2, cfg_scale=1.0)
    assert guided.token_ids[0] == [10, 10]  # token 11: 3.0 + 2 (2.2 - 3.0) = 1.4 < 2.0
    assert model.rows_seen == [2, 2]  # both branches in one forward per step


# --- bad settings ------------------------------------------------------------------------

@pytest.mark.parametrize("settings, message", [
    (dict(gen_length=10, block_length=4), "multiple of block_length"),
    (dict(gen_length=16, block_length=4, steps=6), "multiple of the number of blocks"),
    (dict(gen_length=8, block_length=4, cache="exact"), "block-causal"),
    (dict(gen_length=8, block_length=4, cache="dual", cfg_scale=1.0), "without a cache"),
    (dict(gen_length=8, block_length=4, cache="warm"), "unknown cache"),
])
def test_bad_settings_say_what_to_fix(settings, message):
    with pytest.raises(BlockspecError, match=message):
        run(tiny_dllm(), **settings)


def test_bad_scheduler_names_say_what_to_choose():
    with pytest.raises(BlockspecError, match="choose one of"):
        Scheduler(score="loudness")
