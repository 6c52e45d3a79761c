"""Speculative sampling must follow the target's own sampling distribution exactly."""

import pytest
import torch

import blockspec.decoding.verifier as verify_module
from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.decoding.verifier import TargetScores, verify_chain
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.sampling import SamplingConfig, sample_from, sampling_probs
from helpers import (
    PASS,
    PROMPT,
    SAMPLES,
    VOCAB,
    chi_square_pvalue,
    exact_joint,
    make_dflash,
    sampled_joint,
    small_target,
)

# --- the verifier on its own: known p and q ------------------------------------------------


def emitted_first_token(p_logits, q_probs, sampling, generator, deterministic):
    if deterministic:
        draft = q_probs.argmax(dim=-1)
        probs = None
    else:
        draft = sample_from(q_probs, generator)
        probs = q_probs
    verdict = verify_chain(draft, TargetScores(p_logits), sampling, probs, generator)
    return int(draft[0]) if verdict.num_accepted >= 1 else verdict.next_token


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (4, 1.0), (0, 0.7), (5, 0.8)])
def test_verifier_output_follows_target_distribution(deterministic, top_k, top_p):
    generator = torch.Generator().manual_seed(0)
    sampling = SamplingConfig(temperature=0.8, top_k=top_k, top_p=top_p)
    p_logits = torch.randn(2, 6, generator=generator) * 0.7
    q_probs = sampling_probs(torch.randn(1, 6, generator=generator) * 1.5, sampling)
    generator = torch.Generator().manual_seed(1)
    target = sampling_probs(p_logits[0], sampling)
    samples = 6000
    counts = {}
    for _ in range(samples):
        token = emitted_first_token(p_logits, q_probs, sampling, generator, deterministic)
        counts[token] = counts.get(token, 0) + 1
    probs = {t: float(target[t]) for t in range(6) if target[t] > 0}
    assert chi_square_pvalue(counts, probs, samples) > PASS


# --- end to end: the whole loop on a tiny-vocabulary model ---------------------------------

@pytest.fixture(scope="module")
def small_world():
    target = small_target()
    drafter = DFlashDrafter(make_dflash(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, seed=5), target)
    return target, drafter


@pytest.mark.slow
@pytest.mark.parametrize("sampling,sample_drafts", [
    (SamplingConfig(temperature=1.0), True),
    (SamplingConfig(temperature=0.7, top_k=5, top_p=0.9), True),
    (SamplingConfig(temperature=1.0), False),  # greedy drafts, accepted with probability p(draft)
])
def test_speculative_sampling_matches_target_sampling(small_world, sampling, sample_drafts):
    target, drafter = small_world
    drafter.sample_drafts = sample_drafts
    probs = {k: v for k, v in exact_joint(target, sampling).items() if v > 0}
    counts = sampled_joint(target, drafter, sampling, SAMPLES)
    assert chi_square_pvalue(counts, probs, SAMPLES) > PASS


@pytest.mark.slow
def test_the_distribution_test_catches_a_verifier_without_residual(small_world, monkeypatch):
    target, drafter = small_world
    drafter.sample_drafts = True
    sampling = SamplingConfig(temperature=1.0)
    monkeypatch.setattr(verify_module, "_residual", lambda p, q, tokens, index: p[index])
    probs = exact_joint(target, sampling)
    counts = sampled_joint(target, drafter, sampling, SAMPLES)
    assert chi_square_pvalue(counts, probs, SAMPLES) < PASS / 100


def test_same_seed_same_output(small_world):
    target, drafter = small_world
    config = GenerationConfig(max_new_tokens=20, temperature=1.0, seed=123)
    runs = []
    for _ in range(2):
        stream = speculative_generate(target, PROMPT, drafter, config)
        list(stream)
        runs.append(stream.token_ids)
    assert runs[0] == runs[1]
