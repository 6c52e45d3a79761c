"""Speculative sampling must follow the target's own sampling distribution exactly."""

import itertools

import pytest
import torch
from conftest import make_dflash
from scipy.stats import chisquare
from tiny_models import make_causal_lm

import blockspec.decoding.verifier as verify_module
from blockspec.decoding.generate import GenerationConfig, speculative_generate
from blockspec.sampling import SamplingConfig, sample_from, sampling_probs
from blockspec.decoding.verifier import verify
from blockspec.models.dflash import DFlashDrafter

VOCAB = 8
# Fixed seeds make every test deterministic; a correct sampler passes at PASS, and the
# broken one must fall far below it.
PASS = 1e-4
PROMPT = torch.tensor([[1, 2, 3]])
NEW_TOKENS = 3


def chi_square_pvalue(counts: dict, probs: dict, total: int) -> float:
    """Pearson chi-square, pooling cells with an expected count under 5."""
    observed, expected, pool_obs, pool_exp = [], [], 0.0, 0.0
    for cell, p in probs.items():
        if p * total < 5:
            pool_obs, pool_exp = pool_obs + counts.get(cell, 0), pool_exp + p * total
        else:
            observed.append(counts.get(cell, 0))
            expected.append(p * total)
    if pool_exp > 0:
        observed.append(pool_obs)
        expected.append(pool_exp)
    assert sum(counts.values()) == total and set(counts) <= set(probs), "a sample outside the support"
    scale = total / sum(expected)  # float32 probabilities do not sum to exactly 1
    return chisquare(observed, [e * scale for e in expected]).pvalue


# --- the verifier on its own: known p and q ------------------------------------------------

def emitted_first_token(p_logits, q_probs, sampling, generator, deterministic):
    if deterministic:
        draft = q_probs.argmax(dim=-1)
        probs = None
    else:
        draft = sample_from(q_probs, generator)
        probs = q_probs
    verdict = verify(draft, p_logits, sampling, probs, generator)
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


def small_target():
    """The tiny-vocabulary target whose output distribution the tests enumerate exactly."""
    return make_causal_lm("qwen3", vocab_size=VOCAB, seed=11, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.3)


def exact_joint(target, sampling: SamplingConfig) -> dict:
    """P(t1, t2, t3) under plain sampling from the target, by enumeration."""
    joint = {}
    with torch.no_grad():
        for prefix in itertools.product(range(VOCAB), repeat=NEW_TOKENS - 1):
            ids = torch.cat([PROMPT, torch.tensor([prefix])], dim=1)
            probs = sampling_probs(target(ids).logits[0, -NEW_TOKENS:], sampling)
            head = float(probs[0, prefix[0]] * probs[1, prefix[1]])
            for last in range(VOCAB):
                joint[(*prefix, last)] = head * float(probs[2, last])
    return joint


def sampled_joint(target, drafter, sampling: SamplingConfig, samples: int) -> dict:
    counts = {}
    for seed in range(samples):
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, block_size=3, temperature=sampling.temperature,
                                  top_p=sampling.top_p, top_k=sampling.top_k, seed=seed)
        stream = speculative_generate(target, PROMPT, drafter, config)
        list(stream)
        key = tuple(stream.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


SAMPLES = 2500


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
