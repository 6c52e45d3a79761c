"""Every target family with a public DFlash draft decodes losslessly: greedy output equals Hugging Face
``generate`` token for token, for every method, as a chain, a tree and a batch (of chains or trees).

The targets are tiny random models built from transformers' own classes (``tests/helpers.py``
FAMILY_CONFIGS), in float64: full attention (llama, qwen2, qwen3), MoE (qwen3_moe), Gated
DeltaNet linear attention beside full attention (qwen3_5, and with MoE qwen3_next), sliding-window
beside full attention with sinks and MoE (gpt_oss) or per-layer inputs (gemma4), and multi-head
latent attention with MoE (deepseek_v3). Prompts and answers run past the 8-position window, and
the drafters reject often: prompt lookup, a draft model, a random DFlash drafter, and a drafter
that knows the answer but is often wrong (every acceptance length occurs, so every rollback does).
"""

import pytest
import torch

from blockspec.decoding.batch import batch_generate
from blockspec.decoding.linear_states import LinearStates
from blockspec.decoding.policy import WidthPolicies
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.drafters.draft_lm import DraftModelDrafter
from blockspec.drafters.ngram import PromptLookupDrafter
from helpers import (
    FAMILIES,
    FixedCosts,
    NoisyOracle,
    decode,
    hf_greedy,
    make_causal_lm,
    make_dflash,
    perturbed_copy,
    prompts,
    repetitive_prompts,
)

NEW_TOKENS = 32
#: Prompts per family and method: a few in the quick run, 20 in the slow one.
QUICK, ALL = 3, 20
METHODS = ("ngram", "draft", "dflash", "oracle")
TREE_METHODS = ("dflash", "oracle")
#: Families whose cache layers all keep one entry per position (a draft model of the family can crop its own).
CROPPABLE = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
LINEAR = ("qwen3_5", "qwen3_next")
SLIDING = ("gpt_oss", "gemma4")


class PromptOracle(NoisyOracle):
    """A noisy oracle for many prompts at once (a batch): each sequence drafts from its own prompt's answer."""

    def __init__(self, references: list[list[int]], vocab: int, seed: int = 0):
        super().__init__(references[0], vocab, seed)
        self.references = references

    def start(self, prompt_ids, features):
        prompt = prompt_ids[0].tolist()
        reference = next(r for r in self.references if r[:len(prompt)] == prompt)
        return {"position": len(prompt), "reference": reference}

    def draft_logits(self, state, last_token, num_tokens):
        self.reference = state["reference"]
        return super().draft_logits(state, last_token, num_tokens)


class Family:
    """One family's tiny target, its prompts and their greedy answers (computed on first use)."""

    def __init__(self, arch: str):
        self.arch = arch
        self.target = make_causal_lm(arch).double()
        half = ALL // 2
        self.cases = repetitive_prompts(320, half, seed=3) + prompts(320, count=ALL - half, seed=4)
        self.cases = [self.cases[i] for i in _interleaved(half, ALL - half)]
        self._answers: dict[int, list[int]] = {}
        self._drafters: dict[str, object] = {}

    def answer(self, index: int) -> list[int]:
        if index not in self._answers:
            self._answers[index] = hf_greedy(self.target, self.cases[index], NEW_TOKENS)
        return self._answers[index]

    def drafter(self, method: str, index: int):
        if method == "oracle":  # knows the answer, but its first choice is often wrong
            return NoisyOracle(self.reference(index), 320, seed=index)
        if method not in self._drafters:
            self._drafters[method] = self._build(method)
        return self._drafters[method]

    def reference(self, index: int) -> list[int]:
        return self.cases[index][0].tolist() + self.answer(index)

    def _build(self, method: str):
        if method == "ngram":
            return PromptLookupDrafter(block_size=6)
        if method == "dflash":
            return DFlashDrafter(make_dflash(self.target, block_size=8), self.target)
        # a draft model of the family where its own cache can crop; else a small llama of the same vocabulary
        draft = perturbed_copy(self.target) if self.arch in CROPPABLE else \
            make_causal_lm("llama", seed=5, num_hidden_layers=2).double()
        return DraftModelDrafter(draft, self.target, block_size=4)


def _interleaved(a: int, b: int) -> list[int]:
    """Repetitive and random prompts alternating, so any first few hold both kinds."""
    order = []
    for i in range(max(a, b)):
        order += ([i] if i < a else []) + ([a + i] if i < b else [])
    return order


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return Family(request.param)


def chain_outputs(family: Family, method: str, first: int, count: int) -> dict[int, list[int]]:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    return {i: decode(family.target, family.cases[i], family.drafter(method, i), config).token_ids
            for i in range(first, count)}


def tree_outputs(family: Family, method: str, first: int, count: int) -> dict[int, list[int]]:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, tree_budget=10, tree_top_k=3)
    return {i: decode(family.target, family.cases[i], family.drafter(method, i), config).token_ids
            for i in range(first, count)}


def batch_outputs(family: Family, method: str, first: int, count: int, tree_budget: int | None = None
                  ) -> dict[int, list[int]]:
    """Three rows at a time, rows joining as others finish."""
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, tree_budget=tree_budget, tree_top_k=3)
    indices = list(range(first, count))
    drafter = PromptOracle([family.reference(i) for i in indices], 320) if method == "oracle" else \
        family.drafter(method, 0)
    results = batch_generate(family.target, [family.cases[i] for i in indices], drafter, config, max_batch_size=3)
    return {i: result.token_ids for i, result in zip(indices, results)}


def batch_tree_outputs(family: Family, method: str, first: int, count: int) -> dict[int, list[int]]:
    return batch_outputs(family, method, first, count, tree_budget=10)


SHAPES = {"chain": (chain_outputs, METHODS), "tree": (tree_outputs, TREE_METHODS), "batch": (batch_outputs, METHODS),
          "batch-tree": (batch_tree_outputs, TREE_METHODS)}
CELLS = [(shape, method) for shape, (_, methods) in SHAPES.items() for method in methods]


def check_cell(family: Family, shape: str, method: str, first: int, count: int) -> None:
    run, _ = SHAPES[shape]
    for index, tokens in run(family, method, first, count).items():
        assert tokens == family.answer(index), f"{family.arch} {method} {shape}: prompt {index} differs"


@pytest.mark.parametrize("shape,method", CELLS)
def test_greedy_equals_hf_generate(family, shape, method):
    check_cell(family, shape, method, 0, QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("shape,method", CELLS)
def test_greedy_equals_hf_generate_on_20_prompts(family, shape, method):
    """The other prompts of the 20 (the quick test decodes the first ones)."""
    check_cell(family, shape, method, QUICK, ALL)


def test_drafts_are_accepted_and_rejected(family):
    """The oracle's chains accept every length from none to all: each rollback case occurs."""
    accepted = set()
    for index in range(QUICK):
        stream = decode(family.target, family.cases[index], family.drafter("oracle", index),
                        GenerationConfig(max_new_tokens=NEW_TOKENS))
        accepted |= {(a, d) for a, d in zip(stream.stats.accepted, stream.stats.drafted)}
    assert any(a == 0 for a, _ in accepted) and any(0 < a < d for a, d in accepted) and \
        any(a == d > 0 for a, d in accepted)


@pytest.mark.parametrize("arch", LINEAR)
def test_trees_fall_back_to_a_chain_on_linear_attention(arch):
    """A linear-attention state follows one sequence, so a tree cannot be verified in one forward:
    the step verifies the drafter's chain instead, losslessly."""
    family = Family(arch)
    for index in range(2):
        stream = decode(family.target, family.cases[index], family.drafter("oracle", index),
                        GenerationConfig(max_new_tokens=NEW_TOKENS, tree_budget=10))
        assert stream.sequence.config.tree_budget is None
        assert stream.stats.verified == [d + 1 for d in stream.stats.drafted]  # a chain's width each step
        assert stream.token_ids == family.answer(index)


@pytest.mark.parametrize("arch", SLIDING)
def test_sliding_window_targets_verify_real_trees(arch):
    family = Family(arch)
    stream = decode(family.target, family.cases[0], family.drafter("oracle", 0),
                    GenerationConfig(max_new_tokens=NEW_TOKENS, tree_budget=12, tree_top_k=3))
    assert stream.token_ids == family.answer(0)
    assert any(width > depth + 1 for width, depth in zip(stream.stats.verified, stream.stats.drafted))


@pytest.mark.parametrize("arch", ["qwen3_5", "gpt_oss"])
def test_adaptive_width_on_hybrid_targets(arch):
    family = Family(arch)
    policies = WidthPolicies(lambda model, width: FixedCosts([1.0 + 0.03 * w for w in range(width)]))
    for index in range(2):
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, block_size="auto")
        stream = decode(family.target, family.cases[index], family.drafter("oracle", index), config,
                        width_policies=policies)
        assert stream.token_ids == family.answer(index)
        assert len(set(stream.widths)) > 1


@pytest.mark.parametrize("arch", ["qwen3_5", "gpt_oss", "gemma4"])
def test_a_broken_rollback_is_caught(arch, monkeypatch):
    """The comparison can fail: without the linear states' replay, or with sliding layers cropped as if they
    kept every position, outputs part from generate's."""
    if arch in LINEAR:
        monkeypatch.setattr(LinearStates, "rewind", lambda self, cache, kept, width: None)
    else:
        from transformers.cache_utils import DynamicSlidingWindowLayer

        monkeypatch.setattr(DynamicSlidingWindowLayer, "activate_past_recording", lambda self: None)
    family = Family(arch)
    broken = 0
    for index in range(4):
        try:
            tokens = chain_outputs_of_one(family, index)
        except RuntimeError:  # the layer refuses to crop what it no longer holds
            broken += 1
            continue
        broken += tokens != family.answer(index)
    assert broken > 0


def chain_outputs_of_one(family: Family, index: int) -> list[int]:
    return decode(family.target, family.cases[index], family.drafter("oracle", index),
                  GenerationConfig(max_new_tokens=NEW_TOKENS)).token_ids


@pytest.mark.parametrize("arch", ["qwen3_5", "gpt_oss"])
def test_batched_rows_of_hybrid_targets_equal_rows_alone(arch):
    """Rows that join, accept different lengths and leave at different times (stop ids, token limits)."""
    family = Family(arch)
    drafter = family.drafter("ngram", 0)
    configs = [GenerationConfig(max_new_tokens=8 + 5 * i) for i in range(5)]
    results = batch_generate(family.target, family.cases[:5], drafter, configs, max_batch_size=3)
    for i, result in enumerate(results):
        assert result.token_ids == decode(family.target, family.cases[i], drafter, configs[i]).token_ids


def test_cost_measurement_rolls_back_to_the_context():
    """T(w) is timed with keep([[]]): nothing of the block stays, the linear state included."""
    from blockspec.decoding.block import VerifyBlock
    from blockspec.decoding.forward import SequenceTarget

    target = make_causal_lm("qwen3_5").double()
    context = torch.randint(4, 320, (1, 12), generator=torch.Generator().manual_seed(0))
    rolled_back, untouched = SequenceTarget(target, None), SequenceTarget(target, None)
    with torch.inference_mode():
        for sequence in (rolled_back, untouched):
            sequence.prefill(context)
        rolled_back.verify([VerifyBlock([5, 6, 7, 8], 12)])
        rolled_back.keep([[]])
        after, expected = (s.verify([VerifyBlock([9], 12)])[0].scores.logits for s in (rolled_back, untouched))
    assert torch.equal(after, expected)


def test_features_are_each_layers_output(family):
    """``hidden_states[i + 1]`` is decoder layer i's output on every family (the last after the final norm)."""
    from blockspec.models.target import layer_features

    target, outputs = family.target, {}
    layers = target.model.layers
    hooks = [layer.register_forward_hook(lambda module, args, out, i=i: outputs.__setitem__(i, out))
             for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            hidden = target(family.cases[0], output_hidden_states=True).hidden_states
    finally:
        for hook in hooks:
            hook.remove()
    last = len(layers) - 1
    assert torch.equal(layer_features(hidden, [0, 2]), torch.cat([outputs[0], outputs[2]], dim=-1))
    assert torch.equal(layer_features(hidden, [last]), target.model.norm(outputs[last]))


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen3_next"])
def test_router_outputs_are_left_off(arch):
    """A config that asks for MoE router logits decodes the same (they would be a training loss over the masks)."""
    target = make_causal_lm(arch, output_router_logits=True).double()
    cases = prompts(320, count=3, seed=1)
    answers = [hf_greedy(target, ids, 16) for ids in cases]
    config = GenerationConfig(max_new_tokens=16)
    assert [r.token_ids for r in batch_generate(target, cases, PromptLookupDrafter(), config)] == answers
    reference = cases[0][0].tolist() + answers[0]
    tree = GenerationConfig(max_new_tokens=16, tree_budget=6)
    assert decode(target, cases[0], NoisyOracle(reference, 320), tree).token_ids == answers[0]


@pytest.mark.parametrize("arch", [f for f in FAMILIES if f not in ("llama", "qwen2", "qwen3")])
def test_families_the_fast_path_does_not_run_decode_eagerly(arch):
    from blockspec.decoding.compile_policy import compile_choice
    from blockspec.errors import BlockspecError

    target = make_causal_lm(arch)
    assert compile_choice(target, "auto")[0] is False
    with pytest.raises(BlockspecError, match="use --compile off"):
        compile_choice(target, "on")


def test_sparse_indexed_attention_decodes_alone_and_refuses_drafts():
    """DeepSeek-V3.2's indexer picks keys per forward (its own generate differs from a full forward), so a
    verified block could part from token-by-token decoding: drafting is refused, and batching (its indexer
    keys are not spliced); plain decoding of one sequence runs."""
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config

    from blockspec.errors import BlockspecError

    torch.manual_seed(0)
    config = DeepseekV32Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32,
                               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                               num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                               moe_intermediate_size=32, index_n_heads=2, index_head_dim=16, index_topk=4,
                               max_position_embeddings=512, initializer_range=0.2, experts_implementation="eager")
    target = AutoModelForCausalLM.from_config(config).eval().double()
    ids = prompts(320, count=1, seed=2)[0]
    assert decode(target, ids, None, GenerationConfig(max_new_tokens=12)).token_ids == hf_greedy(target, ids, 12)
    with pytest.raises(BlockspecError, match="deepseek_v32 targets cannot verify drafts losslessly"):
        decode(target, ids, PromptLookupDrafter(), GenerationConfig(max_new_tokens=12))
    with pytest.raises(BlockspecError, match="batched decoding cannot hold this target's DynamicIndexedLayer"):
        batch_generate(target, [ids], None, GenerationConfig(max_new_tokens=12))


def test_gemma4_as_published_a_multimodal_model_decodes_text():
    """Gemma 4 checkpoints load as Gemma4ForConditionalGeneration (a text config inside a multimodal one)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma4.configuration_gemma4 import Gemma4Config

    from helpers import tiny_config

    torch.manual_seed(0)
    config = Gemma4Config(text_config=tiny_config("gemma4", 320, initializer_range=0.2).to_dict(),
                          vision_config=None, audio_config=None)
    target = AutoModelForCausalLM.from_config(config).eval().double()
    drafter = DFlashDrafter(make_dflash(target, block_size=8), target)
    cases = prompts(320, count=3, seed=1)
    answers = [hf_greedy(target, ids, NEW_TOKENS) for ids in cases]
    tree = GenerationConfig(max_new_tokens=NEW_TOKENS, tree_budget=8)
    assert [decode(target, ids, drafter, tree).token_ids for ids in cases] == answers
    batch = batch_generate(target, cases, drafter, GenerationConfig(max_new_tokens=NEW_TOKENS))
    assert [row.token_ids for row in batch] == answers


@pytest.mark.parametrize("arch", SLIDING)
@pytest.mark.parametrize("context_length", [3, 20])
def test_a_tree_path_kept_on_a_sliding_window_target_continues_exactly(arch, context_length):
    """Inside the window and past it: once a tree's path is kept, the cache holds what a cache that saw only
    the context and the path holds, and the next forward gives the same logits."""
    from blockspec.decoding.block import VerifyBlock
    from blockspec.decoding.forward import SequenceTarget
    from blockspec.drafters.tree import Tree

    target = make_causal_lm(arch).double()
    context = torch.randint(4, 320, (1, context_length), generator=torch.Generator().manual_seed(0))
    tree = Tree(tokens=[11, 12, 13, 14, 15], parents=[-1, -1, 0, 1, 3], depths=[1, 1, 2, 2, 3])
    tree_target, chain_target = SequenceTarget(target, None), SequenceTarget(target, None)
    with torch.inference_mode():
        for sequence in (tree_target, chain_target):
            sequence.prefill(context)
        tree_target.verify([VerifyBlock([10, *tree.tokens], context_length, tree.parents)])
        tree_target.keep([[0, 2, 4, 5]])  # the root, then nodes 1, 3 and 4: tokens 12, 14, 15
        chain_target.verify([VerifyBlock([10, 12, 14, 15], context_length)])
        chain_target.keep([[0, 1, 2, 3]])
        after = [s.verify([VerifyBlock([16, 17], context_length + 4)])[0].scores.logits
                 for s in (tree_target, chain_target)]
    for ours, theirs in zip(tree_target.cache.layers, chain_target.cache.layers):
        assert ours.get_seq_length() == theirs.get_seq_length() and torch.allclose(ours.keys, theirs.keys)
    assert torch.allclose(after[0], after[1], atol=1e-9)
