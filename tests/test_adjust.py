"""Logit adjustments (penalties, bias, banned words, min-p) are applied at every verified row in that row's own
context: speculative output equals plain decoding with the same adjustments, greedy and sampled."""

import pytest
import torch

from blockspec.decoding.adjust import LogitAdjustments, adjust_scores
from blockspec.decoding.batch import batch_generate
from blockspec.decoding.block import VerifyBlock
from blockspec.decoding.sequence import GenerationConfig
from blockspec.decoding.verifier import TargetScores
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.drafters.draft_lm import DraftModelDrafter
from blockspec.drafters.ngram import PromptLookupDrafter
from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingConfig, sampling_probs
from helpers import (
    MAX_NEW,
    PASS,
    SAMPLES,
    VOCAB,
    NoisyOracle,
    chi_square_pvalue,
    decode,
    exact_joint,
    make_causal_lm,
    make_dflash,
    perturbed_copy,
    prompts,
    repetitive_prompts,
    sampled_joint,
    small_target,
)


def reference_adjust(logits, prompt: list[int], output: list[int], adj: LogitAdjustments):
    """The adjustments written out for one position, in vLLM's order, as plain decoding applies them."""
    logits = logits.float().clone()
    for word in adj.bad_words_ids:
        if len(word) == 1 or (len(output) >= len(word) - 1 and output[len(output) - len(word) + 1:] == list(word[:-1])):
            logits[word[-1]] = float("-inf")
    for token, bias in adj.logit_bias:
        logits[token] += bias
    for token in set(prompt) | set(output):
        if adj.repetition_penalty != 1:
            value = logits[token]
            logits[token] = value / adj.repetition_penalty if value > 0 else value * adj.repetition_penalty
    for token in set(output):
        logits[token] -= adj.frequency_penalty * output.count(token) + adj.presence_penalty
    return logits


# --- the adjustment on hand-built logits -----------------------------------------------------------------

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])


@pytest.mark.parametrize("adj,prompt,output,expected", [
    (LogitAdjustments(), [0], [3], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]),
    (LogitAdjustments(repetition_penalty=2.0), [0, 1], [3], [1.0, -2.0, 0.5, 1.5, -2.0, 1.0]),
    (LogitAdjustments(frequency_penalty=0.5), [0], [3, 3, 5], [2.0, -1.0, 0.5, 2.0, -2.0, 0.5]),
    (LogitAdjustments(presence_penalty=0.5), [0], [3, 3, 5], [2.0, -1.0, 0.5, 2.5, -2.0, 0.5]),
    (LogitAdjustments(logit_bias=((2, 5.0), (0, -100.0))), [], [], [-98.0, -1.0, 5.5, 3.0, -2.0, 1.0]),
    (LogitAdjustments(bad_words_ids=((3,),)), [], [], [2.0, -1.0, 0.5, float("-inf"), -2.0, 1.0]),
    (LogitAdjustments(bad_words_ids=((1, 2, 3),)), [], [0, 1, 2], [2.0, -1.0, 0.5, float("-inf"), -2.0, 1.0]),
    (LogitAdjustments(bad_words_ids=((1, 2, 3),)), [1, 2], [], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]),  # prompt only
    (LogitAdjustments(bad_words_ids=((1, 2, 3),)), [], [2, 1], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]),
    # the bias before the repetition penalty: a token pushed negative is multiplied
    (LogitAdjustments(repetition_penalty=2.0, logit_bias=((0, -3.0),)), [0], [], [-2.0, -1.0, 0.5, 3.0, -2.0, 1.0]),
])
def test_one_position_is_adjusted_as_vllm_does(adj, prompt, output, expected):
    scores = adjust_scores(TargetScores(LOGITS[None]), adj, torch.tensor([prompt], dtype=torch.long), output)
    assert scores.logits[0].tolist() == expected
    assert reference_adjust(LOGITS, prompt, output, adj).tolist() == expected


def test_each_row_of_a_tree_is_adjusted_in_its_own_context():
    adj = LogitAdjustments(frequency_penalty=1.0, bad_words_ids=((4, 5),))
    # root 4 (the last token), drafts: 5 under the root, 4 under it, and 2 under the root
    block = VerifyBlock([4, 5, 4, 2], start=7, parents=[-1, 0, -1])
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    output = [1, 4]
    scores = adjust_scores(TargetScores(logits), adj, torch.tensor([[0, 1]]), output, block)
    contexts = [output, output + [5], output + [5, 4], output + [2]]
    for row, context in enumerate(contexts):
        assert torch.equal(scores.logits[row], reference_adjust(logits[row], [0, 1], context, adj))
    assert scores.logits[0, 5] == float("-inf") and scores.logits[2, 5] == float("-inf")
    assert scores.logits[1, 5] != float("-inf") and scores.logits[3, 5] != float("-inf")


def test_without_adjustments_the_scores_are_untouched():
    scores = TargetScores(LOGITS[None])
    assert adjust_scores(scores, LogitAdjustments(), torch.tensor([[0]]), [1]) is scores


@pytest.mark.parametrize("options,message", [
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"presence_penalty": float("nan")}, "presence_penalty must be a finite number"),
    ({"logit_bias": {3: float("inf")}}, "logit_bias values must be finite"),
    ({"bad_words_ids": [[]]}, "must not hold an empty sequence"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
])
def test_bad_adjustments_are_refused_by_name(options, message):
    with pytest.raises(BlockspecError, match=message):
        GenerationConfig(**options)


def test_token_ids_outside_the_vocabulary_are_refused():
    target = make_causal_lm("qwen3")
    with pytest.raises(BlockspecError, match="token id 999 in logit_bias or bad_words_ids is outside"):
        decode(target, torch.tensor([[1, 2, 3]]), None, GenerationConfig(max_new_tokens=4, logit_bias={999: 1.0}))


def test_min_p_drops_the_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = sampling_probs(logits, SamplingConfig(temperature=1.0, min_p=0.2))
    assert probs[0, 3] == 0 and probs[0, 2] > 0
    assert torch.allclose(probs[0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


# --- greedy decoding: speculative equals plain, and plain equals a loop written out --------------------------

ADJUSTED = [
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 0.8, "presence_penalty": 0.4},
    {"logit_bias": {5: 4.0, 7: -100.0}, "bad_words_ids": [[9], [11, 12]]},
    {"repetition_penalty": 1.2, "frequency_penalty": 0.3, "logit_bias": {6: 2.0}, "bad_words_ids": [[8, 9, 10]]},
]


@pytest.fixture(scope="module")
def world():
    target = make_causal_lm("qwen3", vocab_size=320, seed=4)
    return target, DFlashDrafter(make_dflash(target, block_size=8), target, sample_drafts=False)


def written_out_greedy(target, ids, adj: LogitAdjustments, max_new: int) -> list[int]:
    """Plain greedy decoding with the adjustments, the whole sequence recomputed every token (no cache)."""
    prompt, output = ids[0].tolist(), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = target(torch.tensor([prompt + output])).logits[0, -1]
            output.append(int(reference_adjust(logits, prompt, output, adj).argmax()))
    return output


@pytest.mark.parametrize("options", ADJUSTED)
def test_adjusted_greedy_speculation_equals_adjusted_plain_decoding(world, options):
    """Drafts that are often right (a noisy oracle of the adjusted answer, a near copy of the target) are
    accepted mid-block, where a row's own context differs from the root's."""
    target, dflash = world
    draft_model = DraftModelDrafter(perturbed_copy(target), target, block_size=6)
    accepted = 0
    for ids in repetitive_prompts(320, 3, seed=5) + prompts(320, count=2, seed=6):
        plain = decode(target, ids, None, GenerationConfig(max_new_tokens=MAX_NEW, **options)).token_ids
        assert plain == written_out_greedy(target, ids, GenerationConfig(**options).adjustments, MAX_NEW)
        oracle = NoisyOracle(ids[0].tolist() + plain, 320)
        for drafter, shape in [(dflash, {"block_size": 8}), (dflash, {"block_size": "auto", "tree_budget": 6}),
                               (oracle, {"block_size": 8}), (oracle, {"block_size": 8, "tree_budget": 6}),
                               (draft_model, {"block_size": 6})]:
            config = GenerationConfig(max_new_tokens=MAX_NEW, **shape, **options)
            stream = decode(target, ids, drafter, config)
            assert stream.token_ids == plain, (options, drafter.name, shape)
            accepted += sum(stream.stats.accepted)
    assert accepted > 100


def test_a_banned_pair_drafted_across_a_block_is_caught_in_the_block(world):
    """Ban a pair greedy decoding would produce: the drafts hold it inside one block, so only the row after its
    first token, in its own context, can refuse the second."""
    target, _ = world
    for ids in repetitive_prompts(320, 4, seed=9):
        free = decode(target, ids, None, GenerationConfig(max_new_tokens=MAX_NEW)).token_ids
        pair = free[4:6]
        first = next(i for i in range(len(free)) if free[i:i + 2] == pair)
        options = {"bad_words_ids": [pair]}
        plain = decode(target, ids, None, GenerationConfig(max_new_tokens=MAX_NEW, **options)).token_ids
        assert plain[:first + 1] == free[:first + 1] and plain[first + 1] != free[first + 1]
        oracle = NoisyOracle(ids[0].tolist() + free, 320)  # drafts the banned pair
        for shape in ({"block_size": 8}, {"block_size": 8, "tree_budget": 6}):
            config = GenerationConfig(max_new_tokens=MAX_NEW, **shape, **options)
            assert decode(target, ids, oracle, config).token_ids == plain


def test_a_resumed_sequence_counts_its_earlier_output(world):
    """A request resumed from its tokens so far (its prompt then holds them) penalises them as output."""
    target, drafter = world
    options = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "bad_words_ids": [[40, 41]]}
    for ids in repetitive_prompts(320, 3, seed=10):
        whole = decode(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW, block_size=6, **options))
        done = whole.token_ids[:9]
        rest = decode(target, torch.cat([ids, torch.tensor([done])], dim=1), drafter,
                      GenerationConfig(max_new_tokens=MAX_NEW - 9, block_size=6, earlier_output=9, **options))
        assert done + rest.token_ids == whole.token_ids


def test_adjusted_rows_of_a_batch_equal_plain_decoding(world):
    target, drafter = world
    ids = repetitive_prompts(320, 4, seed=7)
    configs = [GenerationConfig(max_new_tokens=MAX_NEW, block_size=6, **options) for options in ADJUSTED]
    plain = [decode(target, row, None, GenerationConfig(max_new_tokens=MAX_NEW, **options)).token_ids
             for row, options in zip(ids, ADJUSTED)]
    for speculative in (drafter, PromptLookupDrafter()):
        results = batch_generate(target, ids, speculative, configs, max_batch_size=4)
        assert [r.token_ids for r in results] == plain


def test_hugging_face_generate_with_the_same_penalty_gives_the_same_tokens(world):
    """Where Hugging Face has the same processor (repetition over the prompt and the output; single-token bias
    and bans), its ``generate`` gives the same greedy tokens."""
    target, drafter = world
    for ids in repetitive_prompts(320, 3, seed=8):
        ours = decode(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW, block_size=8,
                                                             repetition_penalty=1.4)).token_ids
        hf = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, repetition_penalty=1.4, pad_token_id=0)
        assert ours == hf[0, ids.shape[1]:].tolist()
        ours = decode(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW, block_size=8,
                                                             logit_bias={17: 3.0}, bad_words_ids=[[23]])).token_ids
        hf = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, sequence_bias={(17,): 3.0},
                             bad_words_ids=[[23]], pad_token_id=0)
        assert ours == hf[0, ids.shape[1]:].tolist()


# --- sampling: the exact distribution of plain sampling with the adjustments ----------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("sampling,options", [
    (SamplingConfig(temperature=1.0), {"frequency_penalty": 1.5, "repetition_penalty": 1.5}),
    (SamplingConfig(temperature=0.8, min_p=0.1), {"logit_bias": {2: 1.5}, "bad_words_ids": [[4, 5], [6]],
                                                  "presence_penalty": 1.0}),
])
def test_adjusted_speculative_sampling_follows_adjusted_target_sampling(sampling, options):
    target = small_target()
    drafter = DFlashDrafter(make_dflash(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, seed=5), target)
    adj = GenerationConfig(**options).adjustments
    probs = exact_joint(target, sampling, lambda logits, prompt, output: reference_adjust(logits, prompt, output, adj))
    probs = {k: v for k, v in probs.items() if v > 0}
    counts = sampled_joint(target, drafter, sampling, SAMPLES, block_size=4, **options)
    assert chi_square_pvalue(counts, probs, SAMPLES) > PASS
