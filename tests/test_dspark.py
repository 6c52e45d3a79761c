"""DSpark and Domino drafts: a DFlash backbone whose block positions a head chains (DSpark's Markov head, scored by
its confidence head; Domino's GRU).

Greedy output equals plain decoding for every head kind and both block conventions, as a chain, a tree and a
batch; sampled output follows the target's distribution exactly (the verifier uses the q each position was
really sampled from); DeepSpec's, SpecForge's and vLLM speculators' layouts load and draft alike.
"""

import json

import pytest
import torch

from blockspec.decoding.batch import batch_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.chained import DFlash2Drafter, DominoDrafter, DSparkDrafter
from blockspec.drafters.registry import detect_method
from blockspec.errors import BlockspecError, CheckpointError
from blockspec.models.dflash.checkpoint import load_dflash_model, save_dflash_model
from blockspec.sampling import SamplingConfig, sampling_probs
from helpers import (
    PASS,
    SAMPLES,
    chi_square_pvalue,
    decode,
    exact_joint,
    make_causal_lm,
    make_dflash2,
    make_domino,
    make_dspark,
    prompts,
    sampled_joint,
    small_target,
)

NEW_TOKENS = 24
KINDS = ["vanilla", "gated", "rnn"]


@pytest.fixture(scope="module")
def target():
    return make_causal_lm("qwen3", vocab_size=320).double()


def greedy(target, ids, drafter=None, **options):
    return decode(target, ids, drafter, GenerationConfig(max_new_tokens=NEW_TOKENS, **options)).token_ids


def assert_greedy_equals_plain_decoding(target, drafter, seed: int) -> None:
    """Chains of the drafter's full width, trees, and batches of chains and of trees, on four prompts."""
    cases = prompts(320, count=4, seed=seed)
    expected = [greedy(target, ids) for ids in cases]
    for ids, reference in zip(cases, expected):
        assert greedy(target, ids, drafter, block_size=drafter.max_draft_tokens + 1) == reference
        assert greedy(target, ids, drafter, tree_budget=8, tree_top_k=3) == reference
    for config in (GenerationConfig(max_new_tokens=NEW_TOKENS, block_size=4),
                   GenerationConfig(max_new_tokens=NEW_TOKENS, tree_budget=6, tree_top_k=2)):
        rows = batch_generate(target, cases, drafter, config, max_batch_size=4)
        assert [row.token_ids for row in rows] == expected


@pytest.mark.parametrize("candidates", [64, None], ids=["top-64-rescored", "every-row"])
@pytest.mark.parametrize("anchor", [True, False], ids=["anchor-predicts", "masks-predict"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_chains_trees_and_batches_equal_plain_decoding(target, kind, anchor, candidates):
    drafter = DSparkDrafter(make_dspark(target, kind=kind, anchor=anchor).double(), target,
                            markov_candidates=candidates)
    assert drafter.max_draft_tokens == (6 if anchor else 5)
    assert_greedy_equals_plain_decoding(target, drafter, seed=5)


def test_a_dflash_draft_whose_anchor_slot_predicts_decodes_losslessly(target):
    """sample_from_anchor without a Markov head: a DFlash block of B slots drafting B tokens."""
    from blockspec.drafters.dflash import DFlashDrafter
    from helpers import make_dflash

    model = make_dflash(target, block_size=6).double()
    model.anchor_predicts = True
    drafter = DFlashDrafter(model, target)
    assert drafter.max_draft_tokens == 6
    assert_greedy_equals_plain_decoding(target, drafter, seed=8)


def test_rescoring_the_top_rows_drafts_as_the_whole_head_where_they_hold_its_best(target):
    """With as many candidates as rows, rescoring the top rows is the whole head's bias; with fewer, each candidate
    row of the first position (given the same anchor) scores as under the whole head."""
    model = make_dspark(target, kind="gated").double()
    ids = prompts(320, count=1, seed=12)[0]
    whole = DSparkDrafter(model, target, markov_candidates=None)
    every = DSparkDrafter(model, target, markov_candidates=320)
    few = DSparkDrafter(model, target, markov_candidates=16)
    logits = {name: drafter.row_logits(drafter.start(ids, _features(target, drafter, ids)), 9, 5)[0]
              for name, drafter in (("whole", whole), ("every", every), ("few", few))}
    assert torch.allclose(logits["every"], logits["whole"], atol=1e-6)
    finite = torch.isfinite(logits["few"])
    assert finite.sum(dim=-1).tolist() == [16] * 5
    assert torch.allclose(logits["few"][0][finite[0]], logits["whole"][0][finite[0]], atol=1e-6)


def test_the_markov_head_changes_the_drafts(target):
    """Without its bias the same backbone drafts other tokens: the head is really used."""
    model = make_dspark(target).double()
    drafter = DSparkDrafter(model, target)
    ids = prompts(320, count=1, seed=9)[0]
    with_head = drafter.propose(drafter.start(ids, _features(target, drafter, ids)), 7, 5, SamplingConfig(), None)
    with torch.no_grad():
        model.markov_head.markov_w2.weight.zero_()
    without = drafter.propose(drafter.start(ids, _features(target, drafter, ids)), 7, 5, SamplingConfig(), None)
    assert with_head.tokens.tolist() != without.tokens.tolist()


def test_the_greedy_chain_is_the_top_path_of_a_tree(target):
    drafter = DSparkDrafter(make_dspark(target, kind="rnn").double(), target)
    ids = prompts(320, count=1, seed=3)[0]
    chain = drafter.propose(drafter.start(ids, _features(target, drafter, ids)), 11, 5, SamplingConfig(), None)
    tree, confidences = drafter.draft_tree(drafter.start(ids, _features(target, drafter, ids)), 11, 5, 5, 1)
    assert tree.tokens == chain.tokens.tolist() and tree.parents == [-1, 0, 1, 2, 3]
    assert all(0 < c <= 1 for c in confidences)


def _features(target, drafter, ids):
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in drafter.feature_layers], dim=-1)


# -- sampling ----------------------------------------------------------------------------------------

class IgnoresItsMarkovBias(DSparkDrafter):
    """Broken on purpose: drafts with the Markov head but tells the verifier q without it."""

    def propose(self, state, last_token, num_tokens, sampling, generator):
        proposal = super().propose(state, last_token, num_tokens, sampling, generator)
        if proposal.probs is not None:
            proposal.probs = sampling_probs(self.last_base, sampling)
        return proposal

    def _backbone(self, state, last_token, num_tokens):
        hidden, base = super()._backbone(state, last_token, num_tokens)
        self.last_base = base
        return hidden, base


SAMPLED_DRAFTERS = {
    "dspark-vanilla": lambda target: DSparkDrafter(make_dspark(target, block_size=3, mask_token_id=7), target),
    "dspark-rnn": lambda target: DSparkDrafter(make_dspark(target, kind="rnn", block_size=3, mask_token_id=7), target),
    "domino": lambda target: DominoDrafter(make_domino(target, block_size=3, mask_token_id=7, gru=8, emb=8), target),
    "dflash2": lambda target: DFlash2Drafter(make_dflash2(target, block_size=3, mask_token_id=7, group=8, top_k=3),
                                             target),
}


@pytest.mark.parametrize("name", SAMPLED_DRAFTERS)
def test_sampled_output_follows_the_target_exactly(name):
    """Each position drawn from its distribution given the drafts before it, and that q given to the verifier."""
    target = small_target()
    drafter = SAMPLED_DRAFTERS[name](target)
    sampling = SamplingConfig(temperature=1.0)
    counts = sampled_joint(target, drafter, sampling, SAMPLES, block_size=drafter.max_draft_tokens + 1)
    assert chi_square_pvalue(counts, exact_joint(target, sampling), SAMPLES) > PASS


def test_a_verifier_told_the_wrong_q_is_caught():
    """The test above can fail: q without the Markov bias (what the draws did not come from) skews the output."""
    target = small_target()
    drafter = IgnoresItsMarkovBias(make_dspark(target, block_size=3, mask_token_id=7), target)
    sampling = SamplingConfig(temperature=1.0)
    counts = sampled_joint(target, drafter, sampling, SAMPLES, block_size=4)
    assert chi_square_pvalue(counts, exact_joint(target, sampling), SAMPLES) < PASS / 100


# -- checkpoints -----------------------------------------------------------------------------------------

def drafted(target, model, ids):
    drafter = DSparkDrafter(model.double(), target)
    return drafter.propose(drafter.start(ids, _features(target, drafter, ids)), 5, 6, SamplingConfig(), None)


def copied_weights(ours, directory):
    """A new draft directory with ``ours``'s files but its config.json; ``ours``'s config and its dflash_config."""
    config = json.loads((ours / "config.json").read_text())
    nested = config.pop("dflash_config")
    directory.mkdir()
    for file in ours.iterdir():
        if file.name != "config.json":
            (directory / file.name).write_bytes(file.read_bytes())
    return config, nested


def as_speculators(ours, directory):
    """Our saved DSpark draft rewritten as speculators' trainer writes one (layer config nested, 1-based layers)."""
    config, nested = copied_weights(ours, directory)
    speculators = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
                   "transformer_layer_config": {k: v for k, v in config.items() if k not in (
                       "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                       "sample_from_anchor", "architectures")},
                   "aux_hidden_state_layer_ids": [i + 1 for i in nested["target_layer_ids"]],
                   "block_size": nested["block_size"], "mask_token_id": nested["mask_token_id"],
                   **{k: config[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                             "confidence_head_with_markov", "sample_from_anchor")}}
    (directory / "config.json").write_text(json.dumps(speculators))
    return directory


def as_flat_deepspec(ours, directory):
    """DeepSpec's flat layout: DSpark's architecture name, the read layers as 1-based hidden-state indices."""
    config, nested = copied_weights(ours, directory)
    config.update(architectures=["Qwen3DSparkModel"], block_size=nested["block_size"],
                  mask_token_id=nested["mask_token_id"],
                  aux_hidden_state_layer_ids=[i + 1 for i in nested["target_layer_ids"]])
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("kind", KINDS)
def test_every_layout_loads_and_drafts_as_the_saved_model(target, tmp_path, kind):
    model = make_dspark(target, kind=kind).float()
    save_dflash_model(model, tmp_path / "ours")
    ids = prompts(320, count=1, seed=2)[0]
    expected = drafted(target, make_dspark(target, kind=kind), ids)
    for directory in (tmp_path / "ours", as_speculators(tmp_path / "ours", tmp_path / "speculators"),
                      as_flat_deepspec(tmp_path / "ours", tmp_path / "flat")):
        assert detect_method(directory) == "dspark"
        loaded = load_dflash_model(directory)
        assert loaded.markov_head.kind == kind and loaded.confidence_head is not None and loaded.anchor_predicts
        got = drafted(target, loaded, ids)
        assert got.tokens.tolist() == expected.tokens.tolist()
        assert torch.allclose(got.confidence, expected.confidence, atol=1e-5)


def _edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes,message", [
    ({"markov_head_type": "lstm"}, "markov_head_type 'lstm' is not one blockspec runs"),
    ({"markov_rank": -2}, "markov_rank must be a whole number >= 0"),
    ({"markov_rank": 0}, "a DSpark draft needs its Markov head's markov_rank >= 1"),
    ({"aux_hidden_state_layer_ids": [9]}, "name different layers"),
])
def test_a_dspark_config_blockspec_cannot_honour_is_refused_by_name(target, tmp_path, changes, message):
    save_dflash_model(make_dspark(target, confidence=False).float(), tmp_path / "draft")
    _edit_config(tmp_path / "draft", **changes)
    with pytest.raises(CheckpointError, match=message):
        load_dflash_model(tmp_path / "draft")


def test_a_missing_confidence_head_is_refused_not_initialised(target, tmp_path):
    save_dflash_model(make_dspark(target, confidence=False).float(), tmp_path / "draft")
    _edit_config(tmp_path / "draft", enable_confidence_head=True)
    with pytest.raises(CheckpointError, match="confidence_head"):
        load_dflash_model(tmp_path / "draft")


# -- Domino --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("anchor,prefix", [(False, 0), (True, 0), (False, 2)],
                         ids=["masks-predict", "anchor-predicts", "uncorrected-prefix"])
def test_domino_greedy_chains_trees_and_batches_equal_plain_decoding(target, anchor, prefix):
    drafter = DominoDrafter(make_domino(target, anchor=anchor, prefix=prefix).double(), target)
    assert_greedy_equals_plain_decoding(target, drafter, seed=6)


def test_the_domino_correction_is_the_gru_over_the_tokens_before_each_position(target):
    """Position i's logits: the backbone's plus embed_proj([h_i ; GRU(embeddings of the anchor and drafts before
    i)]), checked against one GRU pass over the whole chain; the first ``prefix`` positions uncorrected."""
    model = make_domino(target, prefix=1).double()
    drafter = DominoDrafter(model, target)
    ids = prompts(320, count=1, seed=4)[0]
    logits, _ = drafter.row_logits(drafter.start(ids, _features(target, drafter, ids)), 9, 5)
    state = drafter.start(ids, _features(target, drafter, ids))
    hidden, base = drafter._backbone(state, 9, 5)
    chain = [9] + logits.argmax(dim=-1).tolist()
    with torch.no_grad():
        states, _ = model.domino_head.prefix_gru(target.get_input_embeddings()(torch.tensor([chain[:5]])))
        correction = model.domino_head.embed_proj(torch.cat([hidden, states[0]], dim=-1))
    assert torch.allclose(logits[0], base[0])
    assert torch.allclose(logits[1:], base[1:] + correction[1:].float(), atol=1e-5)
    assert not torch.allclose(logits[1:], base[1:], atol=1e-2)  # the correction is not negligible


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DominoDraftModel"])
def test_a_domino_draft_loads_by_its_layout_and_drafts_as_saved(target, tmp_path, architecture):
    save_dflash_model(make_domino(target).float(), tmp_path / "draft")
    _edit_config(tmp_path / "draft", architectures=[architecture])
    assert detect_method(tmp_path / "draft") == "domino"
    ids = prompts(320, count=1, seed=2)[0]
    drafter = DominoDrafter(load_dflash_model(tmp_path / "draft").double(), target)
    fresh = DominoDrafter(make_domino(target).double(), target)
    got = drafter.propose(drafter.start(ids, _features(target, drafter, ids)), 5, 5, SamplingConfig(), None)
    want = fresh.propose(fresh.start(ids, _features(target, fresh, ids)), 5, 5, SamplingConfig(), None)
    assert got.tokens.tolist() == want.tokens.tolist()


# -- DFlash2 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("anchor", [False, True], ids=["masks-predict", "anchor-predicts"])
def test_dflash2_greedy_chains_trees_and_batches_equal_plain_decoding(target, anchor):
    drafter = DFlash2Drafter(make_dflash2(target, anchor=anchor, attention_value_scale=0.7, input_embedding_scale=1.3,
                                          output_multiplier=0.8, final_logit_softcapping=20.0).double(), target)
    assert_greedy_equals_plain_decoding(target, drafter, seed=7)


def test_the_selector_walks_each_positions_candidates_given_the_token_before(target):
    model = make_dflash2(target).double()
    drafter = DFlash2Drafter(model, target)
    ids = prompts(320, count=1, seed=4)[0]
    chain = drafter.propose(drafter.start(ids, _features(target, drafter, ids)), 9, 5, SamplingConfig(), None)
    hidden, base = drafter._backbone(drafter.start(ids, _features(target, drafter, ids)), 9, 5)
    previous, walked = 9, []
    with torch.no_grad():
        for position in range(5):
            values, candidates = base[position].topk(4)
            selector = model.candidate_selector
            edges = (selector.predecessor_codebook[previous] * selector.hidden_projection(hidden[position])) @ \
                selector.successor_codebook[candidates].T
            previous = int(candidates[(values + edges.float()).argmax()])
            walked.append(previous)
    assert chain.tokens.tolist() == walked
    assert walked != base.argmax(dim=-1).tolist()  # the selector, not the head's argmax, chose the path


def test_the_grouped_convolution_mixes_each_position_with_the_ones_before_it_in_the_block():
    from blockspec.models.dflash.dflash2 import DFlash2Settings, GroupedConv

    torch.manual_seed(0)
    conv = GroupedConv(8, DFlash2Settings(conv_kernel_size=3, conv_group_size=4, selector_rank=1, selector_top_k=1))
    with torch.no_grad():
        conv.base_kernel.normal_()
    hidden, deltas = torch.randn(2, 5, 8), torch.randn(2, 5, 3, 2)
    with torch.no_grad():
        got = conv._convolve(hidden, deltas, 1)
    base = conv.base_kernel.detach()
    for row in range(2):
        for position in range(5):
            for channel in range(8):
                group = channel // 4
                want = sum((base[1, tap, channel] + deltas[row, position, tap, group]) *
                           hidden[row, position - tap, channel] for tap in range(3) if position - tap >= 0)
                assert got[row, position, channel].item() == pytest.approx(float(want), abs=1e-5)


def test_dflash2_scalars_are_honoured(target):
    ids = prompts(320, count=1, seed=1)[0]

    def base_logits(**scalars):
        drafter = DFlash2Drafter(make_dflash2(target, **scalars).double(), target)
        return drafter._backbone(drafter.start(ids, _features(target, drafter, ids)), 9, 5)[1]

    plain = base_logits()
    assert base_logits(final_logit_softcapping=2.0).abs().max() <= 2.0 < plain.abs().max()
    assert torch.allclose(base_logits(output_multiplier=0.5), plain * 0.5)
    for scalar in ("input_embedding_scale", "attention_value_scale"):
        assert not torch.allclose(base_logits(**{scalar: 1.7}), plain)


def as_speculators_dflash2(ours, directory):
    config, nested = copied_weights(ours, directory)
    layer = {k: v for k, v in config.items() if k not in ("architectures", "is_causal", "sample_from_anchor")}
    speculators = {"speculators_model_type": "dflash2", "architectures": ["DFlash2DraftModel"],
                   "transformer_layer_config": layer, "sliding_window_non_causal": True,
                   "aux_hidden_state_layer_ids": [i + 1 for i in nested["target_layer_ids"]],
                   "block_size": nested["block_size"], "mask_token_id": nested["mask_token_id"],
                   **{k: nested[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}}
    (directory / "config.json").write_text(json.dumps(speculators))
    return directory


def test_dflash2_layouts_load_and_draft_as_saved(target, tmp_path):
    save_dflash_model(make_dflash2(target).float(), tmp_path / "ours")
    ids = prompts(320, count=1, seed=2)[0]
    fresh = DFlash2Drafter(make_dflash2(target).double(), target)
    want = fresh.propose(fresh.start(ids, _features(target, fresh, ids)), 5, 5, SamplingConfig(), None)
    for directory in (tmp_path / "ours", as_speculators_dflash2(tmp_path / "ours", tmp_path / "speculators")):
        assert detect_method(directory) == "dflash2"
        drafter = DFlash2Drafter(load_dflash_model(directory).double(), target)
        got = drafter.propose(drafter.start(ids, _features(target, drafter, ids)), 5, 5, SamplingConfig(), None)
        assert got.tokens.tolist() == want.tokens.tolist()


# -- refusals shared by the families ---------------------------------------------------------------------

@pytest.mark.parametrize("make,nested,message", [
    (make_domino, {"projector_type": "mlp"}, "projector_type 'mlp' is not one blockspec runs"),
    (make_domino, {"gru_hidden_dim": None}, "needs dflash_config.gru_hidden_dim"),
    (make_domino, {"pure_draft_prefix_len": -1}, "pure_draft_prefix_len must be a whole number >= 0"),
    (make_dflash2, {"selector_top_k": None}, "needs dflash_config.selector_top_k"),
    (make_dflash2, {"conv_group_size": 7}, "conv_group_size 7 must divide hidden_size"),
    (make_dflash2, {"selector_rank": 0}, "selector_rank must be a whole number >= 1"),
])
def test_a_dflash_config_of_a_family_blockspec_cannot_honour_is_refused_by_name(target, tmp_path, make, nested,
                                                                                 message):
    save_dflash_model(make(target).float(), tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    config["dflash_config"].update(nested)
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_dflash_model(tmp_path / "draft")


@pytest.mark.parametrize("make,method", [(make_dspark, "dspark"), (make_domino, "domino"), (make_dflash2, "dflash2")])
def test_a_chained_draft_is_run_by_its_own_method_only(target, make, method):
    from blockspec.drafters.dflash import DFlashDrafter
    from blockspec.drafters.registry import METHODS

    with pytest.raises(BlockspecError, match=f"--method {method}"):
        DFlashDrafter(make(target).double(), target)
    drafter_class = {"dspark": DSparkDrafter, "domino": DominoDrafter, "dflash2": DFlash2Drafter}[method]
    with pytest.raises(BlockspecError, match=f"denoise_steps is for DFlash drafters: a {METHODS[method].label} draft"):
        drafter_class(make(target).double(), target, denoise_steps=2)
    other = make_dspark if make is not make_dspark else make_domino
    with pytest.raises(BlockspecError, match="run it as a DFlash drafter"):
        drafter_class(other(target).double(), target)
