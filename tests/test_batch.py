"""Batched decoding: every row equals the same sequence decoded alone, for every method."""

import copy

import pytest
import torch

from blockspec.decoding.batch import BatchEngine, batch_generate
from blockspec.decoding.policy import WidthPolicies
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.drafters.draft_lm import DraftModelDrafter
from blockspec.drafters.eagle3_mtp import RecursiveDrafter
from blockspec.drafters.ngram import PromptLookupDrafter
from blockspec.errors import BlockspecError
from helpers import (
    TWO_FAMILIES,
    FixedCosts,
    decode,
    make_causal_lm,
    make_dflash,
    make_recursive,
    perturbed_copy,
    prompts,
    repetitive_prompts,
)

NUM_PROMPTS = 8
METHODS = ["ar", "dflash", "dflash-reduced", "eagle3", "mtp", "ngram", "draft"]


@pytest.fixture(scope="module", params=TWO_FAMILIES)
def target(request):
    # float64 so that a batched forward and a single-row one cannot disagree by rounding.
    return make_causal_lm(request.param, vocab_size=320).double()


def make_prototype(method, target):
    if method == "ar":
        return None
    if method == "dflash":
        return DFlashDrafter(make_dflash(target, block_size=8), target)
    if method == "dflash-reduced":  # every third token, plus each row's own tokens outside them
        return DFlashDrafter(make_dflash(target, block_size=8), target, draft_vocabulary=torch.arange(0, 320, 3))
    if method in ("eagle3", "mtp"):
        return RecursiveDrafter(make_recursive(method, target, draft_vocab_size=200), target, name=method)
    if method == "ngram":
        return PromptLookupDrafter(block_size=6)
    return DraftModelDrafter(perturbed_copy(target), target, block_size=4)


def mixed_prompts():
    """Different lengths (1 to 39 tokens), half of them repetitive so that ngram drafts."""
    half = NUM_PROMPTS // 2
    return prompts(320, count=half, seed=11) + repetitive_prompts(320, NUM_PROMPTS - half, seed=12)


def alone(target, ids, drafter, config):
    return decode(target, ids, drafter, config)


def varied_configs(method, target, cases, **sampling):
    """Different max_new_tokens per row, and a stop id that occurs mid-output in some rows."""
    configs = []
    for i, ids in enumerate(cases):
        free_run = alone(target, ids, None, GenerationConfig(max_new_tokens=20, **sampling)).token_ids
        stop = (free_run[len(free_run) // 2],) if i % 3 == 0 else ()
        configs.append(GenerationConfig(max_new_tokens=6 + 3 * i, stop_token_ids=stop, **sampling))
    return configs


@pytest.mark.parametrize("method", METHODS)
def test_batched_greedy_rows_equal_rows_decoded_alone(target, method):
    prototype = make_prototype(method, target)
    cases = mixed_prompts()
    configs = varied_configs(method, target, cases)
    results = batch_generate(target, cases, prototype, configs, max_batch_size=4)
    reasons = set()
    for ids, config, result in zip(cases, configs, results):
        expected = alone(target, ids, prototype, config)
        assert result.token_ids == expected.token_ids
        assert result.stats.acceptance_lengths == expected.stats.acceptance_lengths
        assert result.stats.finish_reason == expected.stats.finish_reason
        reasons.add(result.stats.finish_reason)
    assert reasons == {"stop", "length"}
    if method in ("ngram", "draft"):  # drafters that agree with the target, so rows accept different lengths
        assert any(n > 1 for r in results for n in r.stats.acceptance_lengths), "no draft was ever accepted"


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_rows_join_mid_run(target, method):
    prototype = make_prototype(method, target)
    cases = mixed_prompts()
    config = GenerationConfig(max_new_tokens=16)
    engine = BatchEngine(target, prototype, max_batch_size=8)
    rows = [engine.add(cases[0], config), engine.add(cases[1], config)]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps in (2, 3, 5) and len(rows) < len(cases):
            rows += [engine.add(cases[len(rows)], config), engine.add(cases[len(rows) + 1], config)]
    assert len(rows) == len(cases)
    for ids, row in zip(cases, rows):
        assert row.token_ids == alone(target, ids, prototype, config).token_ids
    assert max(engine.batch_sizes) > 2


@pytest.mark.parametrize("method", ["dflash", "draft"])
def test_sampled_rows_are_reproducible_and_match_the_row_alone(target, method):
    prototype = make_prototype(method, target)
    cases = mixed_prompts()[:6]
    configs = [GenerationConfig(max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=100 + i)
               for i in range(len(cases))]
    first = batch_generate(target, cases, prototype, configs, max_batch_size=3)
    second = batch_generate(target, list(reversed(cases)), prototype, list(reversed(configs)),
                            max_batch_size=6)
    for ids, config, a, b in zip(cases, configs, first, reversed(second)):
        assert a.token_ids == b.token_ids
        assert a.token_ids == alone(target, ids, prototype, config).token_ids


def tree_prototypes(target):
    from blockspec.drafters.hybrid import HybridDrafter
    from blockspec.drafters.suffix import SuffixDrafter

    dflash = DFlashDrafter(make_dflash(target, block_size=8), target)
    return {"dflash": dflash, "dflash+lookup": HybridDrafter(dflash, SuffixDrafter(None), name="dflash+lookup")}


@pytest.mark.parametrize("method", ["dflash", "dflash+lookup"])
def test_rows_verifying_token_trees_equal_rows_decoded_alone(target, method):
    """Rows of one batch verify trees of different shapes (and some a chain) in one forward."""
    prototype = tree_prototypes(target)[method]
    cases = mixed_prompts()
    configs = [GenerationConfig(max_new_tokens=14 + i, tree_budget=[6, 12, None][i % 3], block_size=8)
               for i in range(len(cases))]
    results = batch_generate(target, cases, prototype, configs, max_batch_size=4)
    for ids, config, result in zip(cases, configs, results):
        expected = alone(target, ids, prototype, config)
        assert result.token_ids == expected.token_ids
        assert result.stats.acceptance_lengths == expected.stats.acceptance_lengths
    assert any(n > 1 for r in results for n in r.stats.acceptance_lengths)


@pytest.mark.parametrize("method", ["dflash", "dflash-reduced"])
def test_dflash_drafts_many_rows_in_one_pass_as_each_alone(target, method):
    """A batch's DFlash trees come from one pass over every row's block, each row attending its own context:
    the same logits, trees and drafter states as the rows drafted one by one."""
    drafter = make_prototype(method, target)
    states = [decode(target, ids, drafter, GenerationConfig(max_new_tokens=3 + i, block_size=4)).sequence.draft_state
              for i, ids in enumerate(mixed_prompts()[:4])]  # different context lengths, features pending
    last_tokens = [5, 17, 42, 99]
    apart = [copy.deepcopy(state) for state in states]
    together = drafter.rows_logits(states, last_tokens, 7)
    for state, alone_state, token, (logits, row_ids) in zip(states, apart, last_tokens, together):
        expected, expected_ids = drafter.row_logits(alone_state, token, 7)
        torch.testing.assert_close(logits, expected)
        assert torch.equal(row_ids, expected_ids) if row_ids is not None else expected_ids is None
        assert state.pending is None and state.cache.length == alone_state.cache.length
        torch.testing.assert_close(state.cache.keys[-1], alone_state.cache.keys[-1])
    trees = drafter.draft_trees(apart, last_tokens, 7, 12, 4)  # the states have moved on: only shapes to compare
    assert [len(tree) for tree, _ in trees] == [12] * 4


def cheap_widths(model, widest):
    """T(w) nearly flat in the width (and, with no batch measured, B rows of w cost one row of B * w)."""
    return FixedCosts([1.0 + 0.02 * w for w in range(widest)])


@pytest.mark.parametrize("method", ["dflash", "ngram", "dflash+lookup"])
def test_adaptive_rows_equal_greedy_decoding(target, method):
    """Rows with the adaptive width (chains and trees, beside a fixed-width row) share one width a step,
    and every row's tokens equal plain greedy decoding."""
    prototype = tree_prototypes(target)[method] if method != "ngram" else make_prototype("ngram", target)
    cases = mixed_prompts()
    trees = method != "ngram"
    configs = [GenerationConfig(max_new_tokens=16 + i, block_size="auto" if i % 4 else 6,
                                tree_budget=8 if trees and i % 2 else None) for i in range(len(cases))]
    policies = WidthPolicies(cheap_widths)
    results = batch_generate(target, cases, prototype, configs, max_batch_size=4, width_policies=policies)
    for ids, config, result in zip(cases, configs, results):
        plain = GenerationConfig(max_new_tokens=config.max_new_tokens)
        assert result.token_ids == alone(target, ids, None, plain).token_ids
    assert policies.all() and any(n > 0 for r in results for n in r.stats.drafted)
    if method == "ngram":  # repetitive prompts: the lookup's drafts are accepted
        assert any(n > 1 for r in results for n in r.stats.acceptance_lengths)


def test_a_batch_cuts_its_rows_to_one_width(target):
    prototype = make_prototype("dflash", target)
    engine = BatchEngine(target, prototype, max_batch_size=4, width_policies=WidthPolicies(cheap_widths))
    rows = [engine.add(ids, GenerationConfig(max_new_tokens=40, block_size="auto")) for ids in mixed_prompts()[:4]]
    engine.step()  # the prefills
    for _ in range(3):  # far from the token limit, every row drafts 7 tokens; the policy keeps one width of them
        engine.step()
        assert len({row.sequence.widths[-1] for row in rows}) == 1
    (policy,) = engine.width_policies.all()
    assert policy.draft_seconds is not None and set(policy.speedups) == {4}  # tracked per batch size


def test_sampled_tree_rows_match_the_row_alone(target):
    prototype = tree_prototypes(target)["dflash+lookup"]
    cases = mixed_prompts()[:4]
    configs = [GenerationConfig(max_new_tokens=12, temperature=0.8, seed=7 + i, tree_budget=8, block_size=8)
               for i in range(len(cases))]
    for ids, config, result in zip(cases, configs, batch_generate(target, cases, prototype, configs)):
        assert result.token_ids == alone(target, ids, prototype, config).token_ids


def test_cancelled_row_leaves_and_the_others_continue(target):
    cases = mixed_prompts()[:3]
    config = GenerationConfig(max_new_tokens=12)
    engine = BatchEngine(target, None, max_batch_size=4)
    rows = [engine.add(ids, config) for ids in cases]
    engine.step()
    engine.cancel(rows[1])
    while engine.has_work:
        engine.step()
    assert rows[1].stats.finish_reason == "cancelled" and len(rows[1].token_ids) < 12
    for i in (0, 2):
        assert rows[i].token_ids == alone(target, cases[i], None, config).token_ids


def test_holes_are_compacted_away(target):
    """Rows accepting different lengths leave masked holes; the cache stays near the longest row."""
    prototype = make_prototype("ngram", target)
    cases = mixed_prompts()
    engine = BatchEngine(target, prototype, max_batch_size=len(cases))
    rows = [engine.add(ids, GenerationConfig(max_new_tokens=30)) for ids in cases]
    while engine.has_work:
        engine.step()
        if engine.rows:
            longest = max(row.sequence.position for row in engine.rows)
            assert engine.cache.length <= 2 * longest + 8
            assert engine.cache.valid.sum(dim=1).tolist() == [row.sequence.position for row in engine.rows]
    for ids, row in zip(cases, rows):
        assert row.token_ids == alone(target, ids, prototype, GenerationConfig(max_new_tokens=30)).token_ids


def test_fp32_batch_matches_rows_alone():
    target = make_causal_lm("qwen3", vocab_size=320, seed=3)
    prototype = DFlashDrafter(make_dflash(target), target)
    cases = prompts(320, count=4, seed=5)
    config = GenerationConfig(max_new_tokens=16)
    results = batch_generate(target, cases, prototype, config, max_batch_size=4)
    for ids, result in zip(cases, results):
        assert result.token_ids == alone(target, ids, prototype, config).token_ids


def test_bad_input_is_refused_clearly(target):
    with pytest.raises(BlockspecError, match="max_batch_size must be >= 1"):
        BatchEngine(target, None, max_batch_size=0)
    engine = BatchEngine(target, None)
    with pytest.raises(BlockspecError, match="prompt is empty"):
        engine.add(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(BlockspecError, match="needs a drafter"):
        engine.add([5, 6], GenerationConfig(block_size=4))
    with pytest.raises(BlockspecError, match="'auto' needs a drafter"):
        BatchEngine(target, None).add([5, 6], GenerationConfig(block_size="auto"))
    with pytest.raises(BlockspecError, match="a token tree needs a drafter that proposes one"):
        BatchEngine(target, PromptLookupDrafter()).add([5, 6], GenerationConfig(tree_budget=4))
    with pytest.raises(BlockspecError, match="one each"):
        batch_generate(target, [[5, 6]], None, [GenerationConfig()] * 2)


# --- chunked prefill: a long prompt enters over several steps ---------------------------------------------

@pytest.mark.parametrize("compile", ["off", "on"])
@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_rows_prefilled_in_chunks_equal_rows_decoded_alone(target, method, compile):
    """Prompts of 1 to 39 tokens enter 7 tokens a step while other rows decode (and leave, moving the prompt
    being prefilled along): every row equals the row decoded alone, and no step prefills more than 7 tokens."""
    prototype = make_prototype(method, target)
    cases = mixed_prompts()
    configs = [GenerationConfig(max_new_tokens=4 + 2 * (i % 5), block_size=6 if prototype else None)
               for i in range(len(cases))]
    engine = BatchEngine(target, prototype, max_batch_size=3, compile=compile, prefill_chunk=7)
    prefilled = []
    prefill = engine.target.prefill
    engine.target.prefill = lambda ids, **where: (prefilled[-1].append(ids.shape[1]), prefill(ids, **where))[1]
    rows = [engine.add(ids, config) for ids, config in zip(cases, configs)]
    while engine.has_work:
        prefilled.append([])
        engine.step()
    assert max(sum(step) for step in prefilled) <= 7 and sum(map(sum, prefilled)) == sum(c.shape[1] for c in cases)
    assert sum(map(len, prefilled)) > len(cases)  # some prompts entered in several parts
    for row, ids, config in zip(rows, cases, configs):
        assert row.token_ids == alone(target, ids, prototype, config).token_ids


@pytest.mark.parametrize("compile", ["off", "on"])
def test_a_row_cancelled_while_its_prompt_enters_leaves_the_others_untouched(target, compile):
    prototype = make_prototype("dflash", target)
    long_prompt, *others = [ids for ids in mixed_prompts() if ids.shape[1] > 20][:3]
    config = GenerationConfig(max_new_tokens=8, block_size=6)
    engine = BatchEngine(target, prototype, max_batch_size=3, compile=compile, prefill_chunk=5)
    first = engine.add(others[0], config)
    engine.step()  # the first row's prompt enters in parts
    cancelled = engine.add(long_prompt, config)
    while not engine.rows:
        engine.step()
    engine.step()
    assert 0 < engine._prefilled < long_prompt.shape[1]  # part of the long prompt is in
    engine.cancel(cancelled)
    last = engine.add(others[1], config)
    for _ in engine.run():
        pass
    assert cancelled.stats.finish_reason == "cancelled" and cancelled.token_ids == []
    assert first.token_ids == alone(target, others[0], prototype, config).token_ids
    assert last.token_ids == alone(target, others[1], prototype, config).token_ids


def test_prefill_chunk_must_be_positive(target):
    with pytest.raises(BlockspecError, match="prefill_chunk must be >= 1 tokens"):
        BatchEngine(target, None, prefill_chunk=0)


# -- the KV budget --------------------------------------------------------------------------------------

@pytest.mark.parametrize("compile", ["off", "on"])
def test_rows_wait_for_room_in_the_kv_budget_and_answer_as_alone(target, compile):
    """A budget holding two rows of the longest reach: never more than two decode at once, the cache never takes
    more slots than the budget, and every row answers as it would alone."""
    prototype = make_prototype("dflash", target)
    cases = mixed_prompts()
    configs = [GenerationConfig(max_new_tokens=6 + i, block_size=6) for i in range(len(cases))]
    longest = max(ids.shape[1] + config.max_new_tokens for ids, config in zip(cases, configs))
    engine = BatchEngine(target, prototype, max_batch_size=8, compile=compile)
    budget = engine.target.kv_slots(2, longest)
    assert budget < engine.target.kv_slots(3, longest)
    engine.kv_budget = budget
    rows = [engine.add(ids, config) for ids, config in zip(cases, configs)]
    held = []
    while engine.has_work:
        engine.step()
        held.append(engine.kv_slots)
    assert max(engine.batch_sizes) == 2 and max(held) <= budget
    for row, ids, config in zip(rows, cases, configs):
        assert row.token_ids == alone(target, ids, prototype, config).token_ids


def test_a_row_the_kv_budget_could_not_hold_alone_is_refused(target):
    engine = BatchEngine(target, None, max_batch_size=4, kv_budget=10)
    with pytest.raises(BlockspecError, match="more than the budget of 10: ask for fewer new tokens"):
        engine.add([5, 6, 7], GenerationConfig(max_new_tokens=8))
    with pytest.raises(BlockspecError, match="kv_budget must be >= 1"):
        BatchEngine(target, None, kv_budget=0)


def test_the_batch_cache_takes_memory_as_rows_join_and_gives_it_back_as_they_leave(target):
    engine = BatchEngine(target, None, max_batch_size=8, compile="on")
    rows = [engine.add(ids, GenerationConfig(max_new_tokens=4 + 4 * (i == 0))) for i, ids in enumerate(mixed_prompts())]
    allocated = []
    while engine.has_work:
        engine.step()
        allocated.append(engine.target.cache.batch)
    assert max(allocated) == 8 and allocated[-1] == 1  # rows left: a quarter or fewer of the slots frees the rest
    assert all(row.finished for row in rows)
