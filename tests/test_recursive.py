"""EAGLE-3 and MTP drafters: lossless, exact sampling, training = inference, checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.eagle3_mtp import RecursiveDrafter
from blockspec.drafters.registry import build_drafter, detect_method
from blockspec.errors import CheckpointError, IncompatibleDraftError
from blockspec.models.eagle3 import load_eagle3_model
from blockspec.models.mtp import load_mtp_model
from blockspec.models.target import Target, layer_features
from blockspec.sampling import SamplingConfig
from helpers import (
    MAX_NEW,
    PASS,
    PROMPT,
    RECURSIVE_KINDS,
    SAMPLES,
    TWO_FAMILIES,
    chi_square_pvalue,
    decode,
    exact_joint,
    hf_greedy,
    make_causal_lm,
    make_recursive,
    prompts,
    sampled_joint,
    small_target,
)


@pytest.fixture(scope="module", params=TWO_FAMILIES)
def world(request):
    target = make_causal_lm(request.param, vocab_size=320).double()
    return target, [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in prompts(320, count=30)]


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
@pytest.mark.parametrize("block_size,draft_vocab", [pytest.param(2, None, marks=pytest.mark.slow), (5, 100),
                                                    pytest.param(8, None, marks=pytest.mark.slow)])
def test_greedy_equals_hf_generate(world, kind, block_size, draft_vocab):
    target, references = world
    drafter = RecursiveDrafter(make_recursive(kind, target, draft_vocab_size=draft_vocab), target, name=kind)
    for ids, expected in references:
        stream = speculative_generate(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW,
                                                                             block_size=block_size))
        list(stream)
        assert stream.token_ids == expected
        assert all(1 <= n <= block_size for n in stream.stats.acceptance_lengths)
        state = stream.sequence.draft_state
        assert state.fed + state.pending.shape[1] == len(state.tokens)  # one cache row per position


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
@pytest.mark.parametrize("draft_vocab", [None, 150])
def test_training_unroll_equals_inference_recursion(kind, draft_vocab):
    """Step k of the training-time-test unroll at row i is the drafter's (k+1)-th draft after i."""
    target = make_causal_lm("llama", vocab_size=320, seed=2).double()
    model = make_recursive(kind, target, draft_vocab_size=draft_vocab, ttt_steps=4)
    drafter = RecursiveDrafter(model, target, name=kind)
    prompt = torch.randint(4, 320, (1, 9), generator=torch.Generator().manual_seed(3))
    last_token = 17
    with torch.no_grad():
        hidden_states = target(prompt, output_hidden_states=True).hidden_states
    features = layer_features(hidden_states, model.feature_layers)
    state = drafter.start(prompt, features)
    sampling = SamplingConfig(temperature=1.0)
    proposal = drafter.propose(state, last_token, 4, sampling, torch.Generator().manual_seed(0))
    sequence = torch.cat([prompt[0], torch.tensor([last_token]), proposal.tokens]).unsqueeze(0)
    row = prompt.shape[1] - 1
    padded = torch.nn.functional.pad(features, (0, 0, 0, sequence.shape[1] - features.shape[1]))
    with torch.no_grad():
        step_logits = model(target.get_input_embeddings()(sequence), padded,
                            torch.tensor([sequence.shape[1]]), num_steps=4)
    for k, logits in enumerate(step_logits):
        full = drafter._full_vocabulary(logits[0, row].float())
        assert torch.allclose(torch.softmax(full, -1), proposal.probs[k], atol=1e-6), k


@pytest.fixture(scope="module")
def tiny_vocab_target():
    return small_target()


@pytest.mark.slow
@pytest.mark.parametrize("kind,sampling,draft_vocab", [
    ("eagle3", SamplingConfig(temperature=1.0), 6),  # a draft vocabulary smaller than the target's
    ("mtp", SamplingConfig(temperature=0.7, top_k=5, top_p=0.9), None),
])
def test_speculative_sampling_matches_target_sampling(tiny_vocab_target, kind, sampling, draft_vocab):
    model = make_recursive(kind, tiny_vocab_target, draft_vocab_size=draft_vocab, seed=4)
    with torch.no_grad():  # sharper random drafts, so that some are accepted and some rejected
        for parameter in model.parameters():
            parameter.mul_(3.0)
    drafter = RecursiveDrafter(model, tiny_vocab_target, name=kind)
    probs = {k: v for k, v in exact_joint(tiny_vocab_target, sampling).items() if v > 0}
    counts = sampled_joint(tiny_vocab_target, drafter, sampling, SAMPLES)
    assert chi_square_pvalue(counts, probs, SAMPLES) > PASS


def test_drafts_outside_the_draft_vocabulary_have_no_mass(tiny_vocab_target):
    model = make_recursive("eagle3", tiny_vocab_target, draft_vocab_size=5)
    drafter = RecursiveDrafter(model, tiny_vocab_target, name="eagle3")
    features = tiny_vocab_target(PROMPT, output_hidden_states=True).hidden_states
    state = drafter.start(PROMPT, layer_features(features, drafter.feature_layers))
    proposal = drafter.propose(state, 4, 3, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    outside = ~drafter.model.t2d
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(3))
    assert (proposal.probs[:, outside] == 0).all() and drafter.model.t2d[proposal.tokens].all()


# --- checkpoints ----------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    target = make_causal_lm("llama", vocab_size=320, seed=5)
    directories = {}
    for kind in RECURSIVE_KINDS:
        model = make_recursive(kind, target, draft_vocab_size=120)
        model.save_pretrained(tmp_path / kind)
        directories[kind] = tmp_path / kind
    return target, directories


def test_eagle3_checkpoints_use_the_public_keys(saved):
    _, directories = saved
    config = json.loads((directories["eagle3"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 120 and config["target_hidden_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    keys = set(load_file(directories["eagle3"] / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= keys
    assert load_file(directories["eagle3"] / "model.safetensors")["midlayer.self_attn.q_proj.weight"].shape == (64, 128)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_save_and_load_round_trip(saved, kind):
    target, directories = saved
    loader = load_eagle3_model if kind == "eagle3" else load_mtp_model
    loaded = loader(directories[kind])
    original = make_recursive(kind, target, draft_vocab_size=120)
    for name, tensor in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert detect_method(directories[kind]) == kind
    drafter = build_drafter(kind, Target(target, None, "tiny"), str(directories[kind]), block_size=3)
    assert drafter.name == kind and drafter.default_block_size == 3


def rewrite_weights(directory, change):
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def rewrite_config(directory, change):
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind,break_it,message", [
    ("eagle3", lambda d: rewrite_weights(d, lambda t: t.__setitem__("d2t", t["d2t"].flip(0))), "d2t and t2d"),
    ("mtp", lambda d: rewrite_weights(d, lambda t: t["t2d"].__setitem__(0, ~t["t2d"][0])), "d2t and t2d"),
    ("eagle3", lambda d: rewrite_weights(d, lambda t: t.pop("fc.weight")), "fc.weight"),
    ("mtp", lambda d: rewrite_weights(d, lambda t: t.__setitem__("norm.weight", torch.ones(3))), "norm.weight"),
    ("eagle3", lambda d: rewrite_config(d, lambda c: c.__setitem__("architectures", ["LlamaForCausalLM"])),
     "not an EAGLE-3 draft"),
    ("mtp", lambda d: rewrite_config(d, lambda c: c.pop("num_target_layers")), "num_target_layers"),
    ("eagle3", lambda d: rewrite_config(d, lambda c: (c.pop("eagle_config"), c.pop("num_target_layers"))),
     "which target layers"),
    ("mtp", lambda d: (d / "model.safetensors").unlink(), "weights"),
])
def test_bad_checkpoints_give_clear_errors(saved, kind, break_it, message):
    _, directories = saved
    break_it(directories[kind])
    loader = load_eagle3_model if kind == "eagle3" else load_mtp_model
    with pytest.raises(CheckpointError, match=message):
        loader(directories[kind])


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
@pytest.mark.parametrize("other,message", [
    (dict(vocab_size=400), "vocabulary 320"),
    (dict(hidden_size=96), "hidden size 64"),
    (dict(num_hidden_layers=6), "4 layers"),
])
def test_a_draft_for_another_target_is_refused(saved, kind, other, message):
    _, directories = saved
    other_target = make_causal_lm("llama", **{"vocab_size": 320, **other})
    with pytest.raises(IncompatibleDraftError, match=message):
        build_drafter(kind, Target(other_target, None, "other"), str(directories[kind]))


# -- vLLM speculators' EAGLE-3 layout ------------------------------------------------------------------------

def as_speculators_eagle3(ours, directory, **settings):
    """Our saved EAGLE-3 draft as speculators' trainer writes one: the layer config nested, its one layer named
    ``layers.0``, the embedding saved beside it."""
    config = json.loads((ours / "config.json").read_text())
    top = {key: config.pop(key) for key in ("draft_vocab_size", "target_hidden_size")}
    aux = config.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]
    config.pop("architectures")
    speculators = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                   "transformer_layer_config": config, "eagle_aux_hidden_state_layer_ids": aux,
                   "norm_before_residual": False, "norm_before_fc": False, **top,
                   "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                          "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}},
                   **settings}
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(speculators))
    tensors = {name.replace("midlayer.", "layers.0.", 1): tensor
               for name, tensor in load_file(ours / "model.safetensors").items()}
    tensors["embed_tokens.weight"] = torch.zeros(320, 64)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_a_speculators_eagle3_draft_loads_as_ours(saved, tmp_path):
    target, directories = saved
    theirs = as_speculators_eagle3(directories["eagle3"], tmp_path / "speculators")
    assert detect_method(theirs) == "eagle3"
    with pytest.warns(UserWarning, match="embed_tokens"):
        loaded = load_eagle3_model(theirs)
    ours = load_eagle3_model(directories["eagle3"])
    assert loaded.state_dict().keys() == ours.state_dict().keys()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = prompts(320, count=1, seed=3)[0]
    runs = [decode(target, ids, RecursiveDrafter(model, target, name="eagle3"), GenerationConfig(max_new_tokens=16))
            for model in (ours, loaded)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats.acceptance_lengths == runs[1].stats.acceptance_lengths


def test_norm_before_residual_is_honoured(saved, tmp_path):
    _, directories = saved
    plain = load_eagle3_model(directories["eagle3"])
    with pytest.warns(UserWarning):
        normed = load_eagle3_model(as_speculators_eagle3(directories["eagle3"], tmp_path / "s",
                                                         norm_before_residual=True))
    assert normed.midlayer.norm_before_residual and not plain.midlayer.norm_before_residual
    embeddings, hidden = torch.randn(1, 3, 64), torch.randn(1, 3, 64) * 5
    rope = plain.rotary_emb(hidden, torch.arange(3).unsqueeze(0))
    outputs = [model.midlayer(embeddings, hidden, rope, None, None)[0] for model in (plain, normed)]
    assert not torch.allclose(outputs[0], outputs[1])


@pytest.mark.parametrize("settings,message", [
    ({"norm_before_fc": True}, "norm_before_fc set in config.json"),
    ({"speculators_model_type": "mtp"}, "speculators draft of type 'mtp' is not an EAGLE-3 draft"),
])
def test_speculators_eagle3_settings_blockspec_cannot_run_are_refused(saved, tmp_path, settings, message):
    _, directories = saved
    with pytest.raises(CheckpointError, match=message):
        load_eagle3_model(as_speculators_eagle3(directories["eagle3"], tmp_path / "s", **settings))


def test_a_speculators_eagle3_draft_of_two_layers_is_refused(saved, tmp_path):
    _, directories = saved
    theirs = as_speculators_eagle3(directories["eagle3"], tmp_path / "s")
    rewrite_config(theirs, lambda config: config["transformer_layer_config"].update(num_hidden_layers=2))
    with pytest.raises(CheckpointError, match="drafts of one llama layer, not 2 llama layers"):
        load_eagle3_model(theirs)
