"""The DFlash checkpoint layout: ours saves in it, and one written by other software loads."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.errors import CheckpointError, IncompatibleDraftError
from blockspec.models.dflash.checkpoint import load_dflash_model, save_dflash_model
from blockspec.models.dflash.config import LayerAttention, select_target_layers
from blockspec.models.dflash.modules import apply_rotary
from helpers import make_causal_lm, make_dflash

LAYER_KEYS = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]


def expected_keys(num_layers):
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    keys |= {f"layers.{i}.{name}" for i in range(num_layers) for name in LAYER_KEYS}
    return keys


def test_target_layer_selection_matches_the_reference_rule():
    assert select_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert select_target_layers(30, 1) == [15]
    assert select_target_layers(30, 3) == [1, 14, 27]
    assert select_target_layers(2, 2) == [1, 1]  # a shallow target: never outside its layers


def test_saved_layout_is_the_public_one(tmp_path):
    target = make_causal_lm("llama")
    draft = make_dflash(target, num_layers=3, block_size=8)
    save_dflash_model(draft, tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["num_hidden_layers"] == 3
    assert config["num_target_layers"] == 4
    assert config["dflash_config"] == {"target_layer_ids": [1, 1, 1], "mask_token_id": 3, "block_size": 8}
    weights = load_file(tmp_path / "draft" / "model.safetensors")
    assert set(weights) == expected_keys(3)
    assert weights["fc.weight"].shape == (64, 3 * 64)


def test_round_trip_gives_identical_drafts(tmp_path):
    target = make_causal_lm("qwen3").double()
    draft = make_dflash(target)
    save_dflash_model(draft, tmp_path / "draft")
    loaded = load_dflash_model(tmp_path / "draft")
    ids = torch.randint(4, 320, (1, 12))
    runs = []
    for model in (draft, loaded):
        stream = speculative_generate(target, ids, DFlashDrafter(model, target), GenerationConfig(max_new_tokens=16))
        list(stream)
        runs.append((stream.token_ids, stream.stats.acceptance_lengths))
    assert runs[0] == runs[1]


def write_foreign_checkpoint(directory, *, nested_block_size=True, hidden=64, layers=2, heads=4, kv_heads=2,
                             head_dim=16, vocab=320, target_layers=4, layer_ids=(1, 1), settings=None,
                             dflash_settings=None, sinks=False, extra_weights=()):
    """A checkpoint as the public drafts ship it: written by hand, not by save_pretrained.

    ``settings`` / ``dflash_settings``: more top-level / ``dflash_config`` keys; ``sinks``: each layer's
    ``self_attn.attention_sink_bias``; ``extra_weights``: more tensor names (of shape [hidden])."""
    directory.mkdir(parents=True)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 512,
        "num_target_layers": target_layers, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "target_hidden_size": hidden,  # optional keys serving engines add
        "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": 3,
                          "causal": False, "use_swa": False, "swa_window_size": 0},
    }
    if nested_block_size:
        config["dflash_config"]["block_size"] = 16
    else:
        config["block_size"] = 16
    config.update(settings or {})
    config["dflash_config"].update(dflash_settings or {})
    (directory / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (hidden, len(layer_ids) * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(layers):
        shapes.update({
            f"layers.{i}.input_layernorm.weight": (hidden,), f"layers.{i}.post_attention_layernorm.weight": (hidden,),
            f"layers.{i}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"layers.{i}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"layers.{i}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"layers.{i}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"layers.{i}.self_attn.q_norm.weight": (head_dim,), f"layers.{i}.self_attn.k_norm.weight": (head_dim,),
            f"layers.{i}.mlp.gate_proj.weight": (2 * hidden, hidden),
            f"layers.{i}.mlp.up_proj.weight": (2 * hidden, hidden),
            f"layers.{i}.mlp.down_proj.weight": (hidden, 2 * hidden),
        })
        if sinks:
            shapes[f"layers.{i}.self_attn.attention_sink_bias"] = (heads,)
    shapes.update({name: (hidden,) for name in extra_weights})
    tensors = {k: (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16) for k, shape in shapes.items()}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize("nested_block_size", [True, False])
def test_checkpoint_written_by_other_software_loads(tmp_path, nested_block_size):
    tensors = write_foreign_checkpoint(tmp_path / "foreign", nested_block_size=nested_block_size)
    model = load_dflash_model(tmp_path / "foreign")
    assert model.block_size == 16 and model.mask_token_id == 3 and model.target_layer_ids == [1, 1]
    assert torch.equal(model.layers[1].self_attn.k_proj.weight, tensors["layers.1.self_attn.k_proj.weight"].float())
    target = make_causal_lm("qwen3")
    stream = speculative_generate(target, torch.tensor([[5, 6, 7]]), DFlashDrafter(model, target),
                                  GenerationConfig(max_new_tokens=10))
    list(stream)
    assert stream.stats.new_tokens == 10


def test_missing_weights_are_refused_not_randomly_initialised(tmp_path):
    write_foreign_checkpoint(tmp_path / "partial")
    weights = load_file(tmp_path / "partial" / "model.safetensors")
    del weights["layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "partial" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing 1 weight"):
        load_dflash_model(tmp_path / "partial")


@pytest.mark.parametrize("damage,message", [
    ("no_dir", "does not exist"),
    ("no_config", "no config.json"),
    ("bad_json", "not valid JSON"),
    ("not_dflash", "not a DFlash or DSpark draft"),
    ("no_mask", "mask_token_id"),
    ("no_layer_ids", "lacks dflash_config.target_layer_ids"),
    ("layer_ids_out_of_target", "not all layers of a 4-layer target"),
    ("no_weights", "holds no weights"),
    ("bad_weights", "could not read the weights"),
    ("wrong_shape", "wrong shape|could not read"),
])
def test_broken_checkpoints_get_clear_errors(tmp_path, damage, message):
    directory = tmp_path / "ckpt"
    if damage != "no_dir":
        write_foreign_checkpoint(directory)
    config_path = directory / "config.json"
    if damage == "no_config":
        config_path.unlink()
    elif damage == "bad_json":
        config_path.write_text('{"architectures": ["DFlashDraftModel"], ')
    elif damage in ("not_dflash", "no_mask", "no_layer_ids", "layer_ids_out_of_target"):
        config = json.loads(config_path.read_text())
        if damage == "not_dflash":
            config["architectures"] = ["Qwen3ForCausalLM"]
        elif damage == "no_mask":
            del config["dflash_config"]["mask_token_id"]
        elif damage == "no_layer_ids":
            del config["dflash_config"]["target_layer_ids"]
        else:
            config["dflash_config"]["target_layer_ids"] = [1, 4]
        config_path.write_text(json.dumps(config))
    elif damage == "no_weights":
        (directory / "model.safetensors").unlink()
    elif damage == "bad_weights":
        (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    elif damage == "wrong_shape":
        weights = load_file(directory / "model.safetensors")
        weights["fc.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        load_dflash_model(directory)


# --- the config keys of the public drafts -------------------------------------------------------

def attention_of(tmp_path, name="draft", **options):
    write_foreign_checkpoint(tmp_path / name, **options)
    return load_dflash_model(tmp_path / name).attention


@pytest.mark.parametrize("settings,dflash_settings,expected", [
    # the older drafts: every layer full, seeing the whole block
    ({}, {}, [LayerAttention(None, False), LayerAttention(None, False)]),
    # newer drafts (Qwen3.6, Gemma 4): layer types; sliding layers are causal, sliding_window read although
    # use_sliding_window is unset
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2048}, {"causal": None},
     [LayerAttention(2048, True), LayerAttention(None, False)]),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2048, "use_sliding_window": True},
     {"swa_window_size": 512, "causal": None}, [LayerAttention(512, True), LayerAttention(None, False)]),
    # dflash_config.causal overrides the layer types
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2048}, {"causal": False},
     [LayerAttention(2048, False), LayerAttention(None, False)]),
    # use_swa makes every layer slide, non-causal unless said otherwise (MiMo)
    ({}, {"use_swa": True, "swa_window_size": 128, "causal": None}, [LayerAttention(128, False)] * 2),
    ({}, {"use_swa": True, "swa_window_size": 128, "causal": True}, [LayerAttention(128, True)] * 2),
    ({"is_causal": True}, {"causal": False}, [LayerAttention(None, True)] * 2),
])
def test_per_layer_windows_and_causality_are_read(tmp_path, settings, dflash_settings, expected):
    assert attention_of(tmp_path, settings=settings, dflash_settings=dflash_settings) == expected


def test_a_sliding_layer_without_a_window_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="swa_window_size"):
        attention_of(tmp_path, dflash_settings={"use_swa": True, "swa_window_size": 0})


def draft_pass(model, context, block, *, cache=None):
    """The drafter network's output for a block after ``context`` features (positions from 0)."""
    length = context.shape[1]
    return model(block, torch.arange(length, length + block.shape[1]).unsqueeze(0), context,
                 torch.arange(length).unsqueeze(0), cache)


def random_inputs(model, context_length=12, block_length=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = model.fc.in_features
    return (torch.randn(1, context_length, width, generator=generator),
            torch.randn(1, block_length, model.config.hidden_size, generator=generator))


def test_causal_layers_do_not_see_later_block_positions(tmp_path):
    write_foreign_checkpoint(tmp_path / "causal", dflash_settings={"causal": True})
    model = load_dflash_model(tmp_path / "causal")
    context, block = random_inputs(model)
    changed = block.clone()
    changed[:, 3:] += 1.0
    with torch.no_grad():
        before, after = draft_pass(model, context, block), draft_pass(model, context, changed)
    assert torch.allclose(before[:, :3], after[:, :3]) and not torch.allclose(before[:, 3:], after[:, 3:])


def test_sliding_layers_do_not_see_context_beyond_their_window(tmp_path):
    write_foreign_checkpoint(tmp_path / "swa", dflash_settings={"use_swa": True, "swa_window_size": 5})
    model = load_dflash_model(tmp_path / "swa")
    context, block = random_inputs(model)  # block positions 12..17: the window reaches back to position 8
    changed = context.clone()
    changed[:, :8] += 1.0
    with torch.no_grad():
        before, after = draft_pass(model, context, block), draft_pass(model, changed, block)
        changed[:, 8] += 1.0
        inside = draft_pass(model, changed, block)
    assert torch.allclose(before, after) and not torch.allclose(before[:, 0], inside[:, 0])
    # through the context cache the drafter keeps, the same positions are seen
    cache = model.new_cache()
    with torch.no_grad():
        draft_pass(model, context[:, :7], block[:, :1], cache=cache)
        cached = model(block, torch.arange(12, 18).unsqueeze(0), context[:, 7:], torch.arange(7, 12).unsqueeze(0),
                       cache)
    assert torch.allclose(cached, before, atol=1e-6)


def reference_sink_attention(queries, keys, values, sink):
    """softmax over [scores, sink] per head, the sink's share dropped (what vLLM computes)."""
    scores = queries @ keys.transpose(-1, -2) / queries.shape[-1] ** 0.5
    scores = torch.cat([scores, sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    return torch.softmax(scores, dim=-1)[..., :-1] @ values


def test_attention_sinks_are_loaded_and_used(tmp_path):
    write_foreign_checkpoint(tmp_path / "sinks", kv_heads=4, dflash_settings={"attention_sink_bias": True},
                             sinks=True)
    model = load_dflash_model(tmp_path / "sinks")
    attention = model.layers[0].self_attn
    with torch.no_grad():
        attention.attention_sink_bias.copy_(torch.tensor([2.0, -1.0, 0.5, 4.0]))
    generator = torch.Generator().manual_seed(0)
    queries, keys, values = (torch.randn(1, 4, n, 16, generator=generator) for n in (3, 7, 7))
    extended_keys, extended_values, mask = attention._with_sink(keys, values, None, 3)
    out = torch.nn.functional.scaled_dot_product_attention(queries, extended_keys, extended_values, attn_mask=mask)
    assert torch.allclose(out, reference_sink_attention(queries, keys, values, attention.attention_sink_bias),
                          atol=1e-6)


def test_target_hidden_size_sets_the_feature_width(tmp_path):
    write_foreign_checkpoint(tmp_path / "wide", settings={"target_hidden_size": 64})
    assert load_dflash_model(tmp_path / "wide").fc.in_features == 2 * 64
    write_foreign_checkpoint(tmp_path / "other", settings={"target_hidden_size": 96})
    model = load_pretrained_features(tmp_path / "other")
    with pytest.raises(IncompatibleDraftError, match="target_hidden_size"):
        DFlashDrafter(model, make_causal_lm("qwen3"))


def load_pretrained_features(directory):
    """A draft whose fc reads features of another width (the checkpoint's fc resized to match)."""
    config = json.loads((directory / "config.json").read_text())
    weights = load_file(directory / "model.safetensors")
    weights["fc.weight"] = torch.zeros(64, 2 * config["target_hidden_size"], dtype=torch.bfloat16)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return load_dflash_model(directory)


def test_interleaved_rotary_is_the_halves_rotary_of_permuted_dims():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, 8, generator=generator)
    angles = torch.randn(1, 5, 4, generator=generator)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    halves = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved pair i -> (i, i + 4)
    expected = apply_rotary(x[..., halves], cos, sin, neox=True)
    assert torch.allclose(apply_rotary(x, cos, sin, neox=False)[..., halves], expected, atol=1e-6)
    partial = apply_rotary(x, cos[..., :4], sin[..., :4])  # a partial rotary leaves the last dims alone
    assert torch.equal(partial[..., 4:], x[..., 4:])


def test_is_neox_style_false_changes_the_rotary(tmp_path):
    write_foreign_checkpoint(tmp_path / "neox")
    write_foreign_checkpoint(tmp_path / "interleaved", settings={"is_neox_style": False})
    models = [load_dflash_model(tmp_path / name) for name in ("neox", "interleaved")]
    context, block = random_inputs(models[0])
    with torch.no_grad():
        outputs = [draft_pass(model, context, block) for model in models]
    assert models[1].layers[0].self_attn.neox is False and not torch.allclose(*outputs)


def test_a_separate_mask_embedding_replaces_the_mask_row(tmp_path):
    write_foreign_checkpoint(tmp_path / "mask")
    embedding = torch.randn(64, generator=torch.Generator().manual_seed(3))
    torch.save({"embedding": embedding, "mask_token_id": 3}, tmp_path / "mask" / "mask_embedding.pt")
    model = load_dflash_model(tmp_path / "mask")
    target = make_causal_lm("qwen3")
    block = model.embed_block(target.get_input_embeddings(), torch.tensor([[7, 3, 3]]))
    assert torch.equal(block[0, 1], embedding) and torch.equal(block[0, 0], target.get_input_embeddings().weight[7])
    save_dflash_model(model, tmp_path / "saved")
    assert torch.equal(load_dflash_model(tmp_path / "saved").mask_embedding, embedding)
    torch.save({"embedding": embedding, "mask_token_id": 5}, tmp_path / "mask" / "mask_embedding.pt")
    with pytest.raises(CheckpointError, match="mask_token_id 5"):
        load_dflash_model(tmp_path / "mask")


def test_logit_scale_scales_the_drafts_logits(tmp_path):
    write_foreign_checkpoint(tmp_path / "plain")
    write_foreign_checkpoint(tmp_path / "scaled", settings={"logit_scale": 0.5})
    target = make_causal_lm("qwen3")
    logits = []
    for name in ("plain", "scaled"):
        drafter = DFlashDrafter(load_dflash_model(tmp_path / name), target)
        state = drafter.start(torch.tensor([[5, 6, 7]]), torch.randn(1, 3, 128, generator=torch.Generator()
                                                                                 .manual_seed(0)))
        logits.append(drafter.draft_logits(state, 8, 4))
    assert torch.allclose(logits[1], logits[0] * 0.5, atol=1e-5)


@pytest.mark.parametrize("settings,weights,message", [
    ({"draft_vocab_size": 10**6}, (), "draft_vocab_size 1000000"),
    ({"use_aux_hidden_state": False}, (), "use_aux_hidden_state"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, (), "layer_types chunked_attention"),
    ({}, ("lm_head.weight",), "its own LM head"),
    ({}, ("embed_tokens.weight",), "its own token embedding"),
])
def test_what_cannot_be_honoured_is_refused_by_name(tmp_path, settings, weights, message):
    write_foreign_checkpoint(tmp_path / "draft", settings=settings, extra_weights=weights)
    with pytest.raises(CheckpointError, match=message):
        load_dflash_model(tmp_path / "draft")


def test_a_draft_made_for_another_depth_is_refused(tmp_path):
    write_foreign_checkpoint(tmp_path / "deep", target_layers=6)
    with pytest.raises(IncompatibleDraftError, match="target of 6 layers"):
        DFlashDrafter(load_dflash_model(tmp_path / "deep"), make_causal_lm("qwen3"))


# -- vLLM speculators' DFlash layout --------------------------------------------------------------------------

def as_speculators_layout(ours, directory, **settings):
    """Our saved draft rewritten as speculators' trainer writes a DFlash draft: the layer config nested, the target
    layers as hidden-state indices (+1), the architecture its own; the weights keep their names."""
    config = json.loads((ours / "config.json").read_text())
    nested = config.pop("dflash_config")
    layer = {key: value for key, value in config.items() if key not in ("architectures", "num_target_layers")}
    speculators = {
        "speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": layer, "draft_vocab_size": config.get("draft_vocab_size") or config["vocab_size"],
        "block_size": nested["block_size"], "mask_token_id": nested["mask_token_id"],
        "aux_hidden_state_layer_ids": [i + 1 for i in nested["target_layer_ids"]],
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": nested["block_size"] - 1}],
                               "verifier": {"name_or_path": "tiny-target", "architectures": ["Qwen3ForCausalLM"]}},
        **settings,
    }
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(speculators))
    (directory / "model.safetensors").write_bytes((ours / "model.safetensors").read_bytes())
    return directory


def test_a_speculators_dflash_draft_loads_and_drafts_as_ours(tmp_path):
    from blockspec.drafters.registry import detect_method

    target = make_causal_lm("qwen3").double()
    save_dflash_model(make_dflash(target, num_layers=2, block_size=8), tmp_path / "ours")
    theirs = as_speculators_layout(tmp_path / "ours", tmp_path / "speculators")
    assert detect_method(theirs) == "dflash"
    runs = []
    for directory in (tmp_path / "ours", theirs):
        model = load_dflash_model(directory)
        assert model.target_layer_ids == [1, 1] and model.block_size == 8 and int(model.mask_token_id) == 3
        ids = torch.randint(4, 320, (1, 12), generator=torch.Generator().manual_seed(0))
        stream = speculative_generate(target, ids, DFlashDrafter(model, target), GenerationConfig(max_new_tokens=16))
        list(stream)
        runs.append((stream.token_ids, stream.stats.acceptance_lengths))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("settings,message", [
    ({"speculators_model_type": "domino"}, "speculators_model_type 'domino' is not supported"),
    ({"speculators_model_type": "dspark"}, "a speculators DSpark draft needs markov_rank >= 1"),
    ({"dflash_context_residual": True}, "dflash_context_residual set in config.json"),
    ({"aux_hidden_state_layer_ids": None}, "needs transformer_layer_config, aux_hidden_state_layer_ids"),
])
def test_speculators_settings_blockspec_cannot_run_are_refused_by_name(tmp_path, settings, message):
    target = make_causal_lm("qwen3")
    save_dflash_model(make_dflash(target, block_size=8), tmp_path / "ours")
    theirs = as_speculators_layout(tmp_path / "ours", tmp_path / "speculators", **settings)
    with pytest.raises(CheckpointError, match=message):
        load_dflash_model(theirs)
