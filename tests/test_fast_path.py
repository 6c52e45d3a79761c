"""The fast path: a static KV cache, linear layers on measured kernels, compiled forwards; lossless against eager."""

import pytest
import torch

from blockspec.decoding.block import VerifyBlock
from blockspec.decoding.compile_policy import compile_choice
from blockspec.decoding.fast import FastForward, bucket_width
from blockspec.decoding.forward import SequenceTarget
from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.decoding.static_cache import StaticKVCache, capacity_for
from blockspec.decoding.static_targets import StaticTarget
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.drafters.tree import Tree
from blockspec.errors import BlockspecError
from blockspec.models.packed import KERNEL_ENV, KernelPlan, linear_layers, module_twin
from blockspec.sampling import SamplingConfig
from helpers import (
    MAX_NEW,
    PASS,
    PROMPT,
    SAMPLES,
    TWO_FAMILIES,
    VOCAB,
    NoisyOracle,
    chi_square_pvalue,
    decode,
    exact_joint,
    hf_greedy,
    make_causal_lm,
    make_dflash,
    prompts,
    sampled_joint,
    small_target,
)


@pytest.fixture(scope="module", params=TWO_FAMILIES)
def world(request):
    target = make_causal_lm(request.param, vocab_size=320)  # fp32: the packed path runs
    return target, [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in prompts(320, count=16, seed=41)]


# --- the cache and its rollback against the dynamic cache's ------------------------------------------------

def verify_rows(target, tokens, start, tree=None):
    out = target.verify([VerifyBlock(tokens, start, None if tree is None else tree.parents)])[0]
    return out.scores.logits, out.features


@pytest.mark.parametrize("arch", TWO_FAMILIES)
def test_rollback_and_tree_compaction_leave_the_cache_the_dynamic_cache_leaves(arch):
    model = make_causal_lm(arch, vocab_size=320, seed=3)
    layers = [0, 2, 3]
    dynamic = SequenceTarget(model, layers)
    static = StaticTarget(FastForward(model, layers, compile=False), 200)
    prompt = prompts(320, count=1, seed=5)[0]
    tree = Tree(tokens=[11, 12, 13, 14, 15], parents=[-1, -1, 0, 0, 2], depths=[1, 1, 2, 2, 3])
    steps = [([7, 8, 9, 10], None, [0, 1]),           # a chain: two rows kept
             ([21] + tree.tokens, tree, [0, 1, 3, 5]),  # a tree: the path 0 -> 2 -> 4, compacted
             ([5, 6], None, [0, 1]),                   # everything kept
             ([30, 31, 32], None, [0])]                # nothing but the last token
    with torch.inference_mode():
        for target in (dynamic, static):
            target.prefill(prompt)
        start = prompt.shape[1]
        for tokens, shape, kept in steps:
            for target in (dynamic, static):
                target.verify([VerifyBlock(tokens, start, None if shape is None else shape.parents)])
                target.keep([kept])
            start += len(kept)
            expected, expected_features = verify_rows(dynamic, [40, 41, 42], start)
            logits, features = verify_rows(static, [40, 41, 42], start)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(features, expected_features, rtol=1e-4, atol=1e-4)
            for target in (dynamic, static):
                target.keep([[]])
        assert static.cache.lengths == [start]


def test_the_last_layer_feature_is_the_normed_one_hidden_states_gives():
    """hidden_states[L] of a Hugging Face forward is the last layer's output after the final norm."""
    model = make_causal_lm("llama", vocab_size=320, seed=4)
    ids = prompts(320, count=1, seed=6)[0]
    with torch.inference_mode():
        expected = model(input_ids=ids, output_hidden_states=True).hidden_states
        features = StaticTarget(FastForward(model, [3, 1], compile=False), 64).prefill(ids).features
    torch.testing.assert_close(features, torch.cat([expected[4], expected[2]], dim=-1), rtol=1e-4, atol=1e-4)


def test_block_visibility_of_a_chain_and_a_tree():
    chain = VerifyBlock([5, 6, 7], 10)
    assert chain.visibility.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert chain.is_chain and chain.depths == [0, 1, 2]
    tree = VerifyBlock([5, 6, 7, 8, 9], 10, parents=[-1, -1, 0, 2])  # nodes 0, 1 under the root, 2 under 0, 3 under 2
    assert tree.visibility[4].tolist() == [True, True, False, True, True]
    assert tree.visibility[2].tolist() == [True, False, True, False, False]
    assert not tree.is_chain and tree.depths == [0, 1, 1, 2, 3]
    assert VerifyBlock([5, 6, 7], 10, parents=[-1, 0]).is_chain  # a chain written as a tree is one
    with pytest.raises(ValueError, match="2 drafts, not 3 parents"):
        VerifyBlock([5, 6, 7], 10, parents=[-1, 0, 1])


def test_capacities_come_from_a_few_sizes():
    assert [capacity_for(n) for n in (1, 512, 513, 3000)] == [512, 512, 1024, 4096]
    assert [bucket_width(w) for w in (1, 3, 5, 16, 17)] == [1, 4, 8, 16, 32]
    with pytest.raises(BlockspecError, match="wider than the fast path's widest"):
        bucket_width(65)


def test_a_batch_row_writes_only_its_own_columns():
    model = make_causal_lm("llama", vocab_size=320)
    cache = StaticKVCache(model.config, batch=2, capacity=16, dtype=torch.float32, device="cpu")
    cache.write_columns = torch.tensor([[3, 4], [7, 8]])
    key = torch.ones(2, 2, 2, 16)
    key[1] *= 2
    cache.update(key, key.clone(), 0)
    written = cache.keys[0][:, 0, :, 0]
    assert written[0].nonzero().flatten().tolist() == [3, 4] and written[1].nonzero().flatten().tolist() == [7, 8]
    assert written[1, 7] == 2


# --- losslessness through the packed eager fast path -------------------------------------------------------

def test_the_packed_twin_shares_the_model_and_leaves_it_as_it_was():
    model = make_causal_lm("llama", vocab_size=320)
    twin = module_twin(model, plan=KernelPlan.uniform("onednn", linear_layers(model)))
    assert type(model.lm_head) is torch.nn.Linear and type(twin.lm_head).__name__ == "PlannedLinear"
    assert twin.model.embed_tokens.weight is model.model.embed_tokens.weight
    ids = prompts(320, count=1)[0]
    with torch.inference_mode():
        torch.testing.assert_close(twin(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["aten", "onednn"])
@pytest.mark.parametrize("block_size,tree_budget", [(1, None), (4, None), (8, None), (8, 12)])
def test_fast_path_greedy_equals_hf_generate(world, block_size, tree_budget, kernel, monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, kernel)
    target, references = world
    drafter = DFlashDrafter(make_dflash(target, block_size=8), target, packed=True)
    fast = FastForward(target, drafter.feature_layers, compile=False)
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, tree_budget=tree_budget)
    for ids, expected in references:
        assert decode(target, ids, drafter, config, fast=fast).token_ids == expected


def test_fast_path_trees_beat_chains_and_stay_lossless(world):
    target, references = world
    fast = FastForward(target, None, compile=False)
    for ids, expected in references[:8]:
        reference = ids[0].tolist() + expected
        stream = decode(target, ids, NoisyOracle(reference, 320, seed=2),
                        GenerationConfig(max_new_tokens=MAX_NEW, tree_budget=16), fast=fast)
        assert stream.token_ids == expected and stream.stats.tau > 1.5


def test_compile_off_keeps_the_eager_forward_and_auto_skips_tiny_targets():
    model = make_causal_lm("llama", vocab_size=320)
    stream = speculative_generate(model, prompts(320, count=1)[0], None, GenerationConfig(max_new_tokens=4))
    assert stream.fast is None
    compiled, reason = compile_choice(model, "auto")
    assert not compiled and "runs eagerly" in reason
    assert compile_choice(model, "on")[0] and not compile_choice(model, "off")[0]


def test_an_unsupported_target_is_refused_by_name_with_compile_on():
    model = make_causal_lm("qwen3", vocab_size=320, use_sliding_window=True, sliding_window=8,
                           layer_types=["sliding_attention"] * 4)
    with pytest.raises(BlockspecError, match="sliding-window layers: use --compile off"):
        compile_choice(model, "on")
    assert not compile_choice(model, "auto")[0]
    with pytest.raises(BlockspecError, match="compile must be one of auto, on, off"):
        GenerationConfig(compile="fast")


# --- the compiled path ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled_world(tmp_path_factory):
    from blockspec.decoding.compile_policy import configure_inductor

    configure_inductor(str(tmp_path_factory.mktemp("inductor")))
    target = make_causal_lm("llama", vocab_size=320, num_hidden_layers=2, seed=7)
    drafter = DFlashDrafter(make_dflash(target, num_layers=1, block_size=4), target, packed=True)
    return target, drafter, FastForward(target, drafter.feature_layers, compile=True)


@pytest.mark.slow
def test_the_compiled_path_is_lossless_and_never_compiles_as_the_context_grows(compiled_world):
    target, drafter, fast = compiled_world
    references = [(ids, hf_greedy(target, ids, 60)) for ids in prompts(320, count=4, seed=43)]
    for tree_budget in (None, 3):
        config = GenerationConfig(max_new_tokens=60, block_size=4, tree_budget=tree_budget)
        for ids, expected in references:
            assert decode(target, ids, drafter, config, fast=fast).token_ids == expected
    graphs = fast.stats.graphs
    assert graphs <= 3  # one per bucket (1, 2, 4), whatever the length: 60 new tokens on every prompt
    long_prompt = prompts(320, count=1, seed=44)[0].repeat(1, 4)
    decode(target, long_prompt, drafter, GenerationConfig(max_new_tokens=200, block_size=4), fast=fast)
    assert fast.stats.graphs == graphs


@pytest.mark.slow
def test_warming_up_for_long_sequences_compiles_the_smaller_caches_too(compiled_world):
    target, drafter, _ = compiled_world
    fast = FastForward(target, drafter.feature_layers, compile=True)
    fast.warm_up(4, 900)  # a server warms up for its longest requests
    graphs = fast.stats.graphs
    assert graphs == 3 * 2  # widths 1, 2, 4 at capacities 512 and 1024
    ids = prompts(320, count=1, seed=46)[0]
    config = GenerationConfig(max_new_tokens=20, block_size=4)
    assert decode(target, ids, drafter, config, fast=fast).token_ids == hf_greedy(target, ids, 20)
    assert fast.stats.graphs == graphs  # a short request compiles nothing
    assert fast.new_cache(40).capacity < fast.new_cache(900).capacity  # and runs in the smaller cache


@pytest.mark.slow
def test_a_thread_of_its_own_compiles_a_graph_per_bucket(compiled_world):
    """Dynamo's recompile limit is per thread; past it graphs would silently run eagerly (a server decodes in
    a thread of its own)."""
    import threading

    import torch._dynamo

    from blockspec.decoding.compile_policy import GRAPH_LIMIT

    target, drafter, _ = compiled_world
    ids = prompts(320, count=1, seed=45)[0]
    seen = {}

    def decode_in_thread():
        seen["default"] = torch._dynamo.config.recompile_limit
        fast = FastForward(target, drafter.feature_layers, compile=True)  # its graphs are new to it
        seen["tokens"] = decode(target, ids, drafter, GenerationConfig(max_new_tokens=12, block_size=4),
                                fast=fast).token_ids
        seen["limit"] = torch._dynamo.config.recompile_limit

    thread = threading.Thread(target=decode_in_thread)
    thread.start()
    thread.join()
    assert seen["default"] < GRAPH_LIMIT <= seen["limit"]
    assert seen["tokens"] == hf_greedy(target, ids, 12)


@pytest.mark.slow
def test_sampling_through_the_compiled_path_follows_the_target():
    target = small_target()
    drafter = DFlashDrafter(make_dflash(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, seed=5),
                            target, packed=True)
    fast = FastForward(target, drafter.feature_layers, compile=True)
    sampling = SamplingConfig(temperature=1.0)
    probs = {k: v for k, v in exact_joint(target, sampling).items() if v > 0}
    counts = sampled_joint(target, drafter, sampling, SAMPLES, fast=fast)
    assert chi_square_pvalue(counts, probs, SAMPLES) > PASS
    assert PROMPT.shape[1] + 3 < fast.new_cache(8).capacity


# --- batches through the fast path ----------------------------------------------------------------------

@pytest.mark.parametrize("method", ["ar", "dflash", "ngram", "dflash trees"])
def test_batched_rows_through_the_fast_path_equal_rows_decoded_alone(world, method):
    from blockspec.decoding.batch import BatchEngine
    from blockspec.drafters.ngram import PromptLookupDrafter

    target, references = world
    dflash = DFlashDrafter(make_dflash(target, block_size=8), target, packed=True)
    drafter = {"ar": None, "ngram": PromptLookupDrafter(block_size=6), "dflash": dflash, "dflash trees": dflash}[method]
    trees = [6, None, 10] if method == "dflash trees" else [None]  # rows of one batch: trees and a chain
    engine = BatchEngine(target, drafter, max_batch_size=3, compile="on")
    configs = [GenerationConfig(max_new_tokens=8 + 2 * i, stop_token_ids=(expected[5],) if i % 3 == 0 else (),
                                tree_budget=trees[i % len(trees)])
               for i, (_, expected) in enumerate(references)]
    rows = [engine.add(ids, config) for (ids, _), config in zip(references[:4], configs)]
    steps = 0
    while engine.has_work:  # rows finish and leave at different steps; new ones join mid-run
        engine.step()
        steps += 1
        if steps % 3 == 0 and len(rows) < len(references):
            rows.append(engine.add(references[len(rows)][0], configs[len(rows)]))
    assert type(engine.target).__name__ == "StaticBatchTarget" and max(engine.batch_sizes) == 3
    for (ids, expected), config, row in zip(references, configs, rows):
        assert row.token_ids == decode(target, ids, drafter, config).token_ids


def test_the_batch_cache_follows_the_rows_decoding(world):
    """Rows that may ask for long answers do not reserve them: the static cache grows as the longest row needs,
    keeps every row's tokens identical to decoding alone, and shrinks back once the long rows have left."""
    from blockspec.decoding.batch import BatchEngine
    from blockspec.decoding.static_cache import MIN_CAPACITY

    target, references = world
    engine = BatchEngine(target, None, max_batch_size=3, compile="on")
    long_ids, long_expected = references[0]
    long_config = GenerationConfig(max_new_tokens=MIN_CAPACITY + 40)
    short = [engine.add(ids, GenerationConfig(max_new_tokens=4, stop_token_ids=(expected[3],)))
             for ids, expected in references[1:3]]
    engine.step()
    assert engine.target.cache.capacity == MIN_CAPACITY  # 4 tokens wanted, nothing reserved for more
    long_row = engine.add(long_ids, long_config)
    capacities = []
    while engine.has_work:
        engine.step()
        capacities.append(engine.target.cache.capacity)
    assert max(capacities) > MIN_CAPACITY and capacities[-1] == MIN_CAPACITY  # grown for the long row, then freed
    assert long_row.token_ids == decode(target, long_ids, None, long_config).token_ids
    for (ids, expected), row in zip(references[1:3], short):
        assert row.token_ids == expected[:len(row.token_ids)]
