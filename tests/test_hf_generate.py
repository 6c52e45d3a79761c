"""blockspec's decoding inside Hugging Face ``model.generate`` (``custom_generate``): lossless against plain
``generate``, every setting honoured or refused by name."""

import pytest
import torch

from blockspec.decoding.hf_generate import hf_custom_generate
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.drafters.eagle3_mtp import RecursiveDrafter
from blockspec.drafters.ngram import PromptLookupDrafter
from blockspec.drafters.suffix import SuffixDrafter, SuffixStore
from helpers import TWO_FAMILIES, make_causal_lm, make_dflash, make_recursive, prompts, repetitive_prompts

MAX_NEW = 24
EOS = 7


@pytest.fixture(scope="module", params=TWO_FAMILIES)
def target(request):
    model = make_causal_lm(request.param, vocab_size=320)
    model.generation_config.pad_token_id = 0
    return model


def drafter_of(kind, target):
    if kind == "dflash":
        return DFlashDrafter(make_dflash(target, block_size=8), target)
    if kind == "eagle3":
        return RecursiveDrafter(make_recursive("eagle3", target), target, name="eagle3")
    if kind == "ngram":
        return PromptLookupDrafter(block_size=6)
    if kind == "suffix":
        return SuffixDrafter(SuffixStore())
    return None


def plain(target, ids, **options):
    return target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, **options)


@pytest.mark.parametrize("kind,block_size,tree_budget", [
    ("dflash", None, None), ("dflash", 6, None), ("dflash", None, 8), ("suffix", None, 8), ("suffix", 6, None),
    ("eagle3", None, None), ("eagle3", 4, None), ("ngram", 6, None), (None, None, None)])
def test_greedy_output_is_plain_generates(target, kind, block_size, tree_budget):
    decoding = hf_custom_generate(drafter_of(kind, target), block_size=block_size, tree_budget=tree_budget)
    for ids in prompts(320, count=6, seed=3) + repetitive_prompts(320, count=2, seed=4):
        expected = plain(target, ids)
        assert torch.equal(plain(target, ids, custom_generate=decoding), expected)


def test_the_end_of_sequence_token_stops_a_row_and_shorter_rows_are_padded(target):
    decoding = hf_custom_generate(drafter_of("dflash", target))
    rows = prompts(320, count=3, seed=8)
    width = max(ids.shape[1] for ids in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, ids in enumerate(rows):  # left padding, as decoder-only generate takes it
        batch[row, width - ids.shape[1]:] = ids[0]
        mask[row, width - ids.shape[1]:] = 1
    for eos in (EOS, int(plain(target, rows[0])[0, rows[0].shape[1] + 3])):  # the 4th token: a stop mid-answer
        out = target.generate(batch, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                              custom_generate=decoding)
        for row, ids in enumerate(rows):
            alone = plain(target, ids, eos_token_id=eos)[0, ids.shape[1]:].tolist()
            ours = out[row, width:].tolist()
            assert ours[:len(alone)] == alone and set(ours[len(alone):]) <= {0}


def test_sampling_with_top_k_one_is_greedy_and_follows_torch_manual_seed(target):
    decoding = hf_custom_generate(drafter_of("dflash", target), block_size=6)  # a width set by time would not repeat
    ids = prompts(320, count=1, seed=11)[0]
    greedy = plain(target, ids)
    assert torch.equal(target.generate(ids, max_new_tokens=MAX_NEW, do_sample=True, top_k=1, temperature=0.7,
                                       custom_generate=decoding), greedy)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(target.generate(ids, max_new_tokens=MAX_NEW, do_sample=True, top_k=0, temperature=1.5,
                                    custom_generate=decoding))
    assert torch.equal(runs[0], runs[1])


def test_return_dict_in_generate_gives_the_sequences(target):
    ids = prompts(320, count=1, seed=13)[0]
    out = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True,
                          custom_generate=hf_custom_generate(drafter_of("ngram", target), block_size=6))
    assert torch.equal(out.sequences, plain(target, ids))


@pytest.mark.parametrize("options,named", [
    ({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
    ({"do_sample": True, "min_p": 0.1}, "MinPLogitsWarper"),
    ({"max_time": 5.0}, "MaxTimeCriteria"),
    ({"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
    ({"output_logits": True, "return_dict_in_generate": True}, "output_logits"),
])
def test_what_the_loop_cannot_honour_is_refused_by_name(target, options, named):
    ids = prompts(320, count=1, seed=14)[0]
    with pytest.raises(ValueError, match=named):
        target.generate(ids, max_new_tokens=MAX_NEW, custom_generate=hf_custom_generate(None), **options)


def test_a_prompt_padded_on_the_right_is_refused(target):
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="pad on the left"):
        target.generate(ids, attention_mask=torch.tensor([[1, 1, 0, 1]]), max_new_tokens=4, do_sample=False,
                        custom_generate=hf_custom_generate(None))
