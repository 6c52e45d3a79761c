"""The DFlash checkpoint layout: ours saves in it, and one written by other software loads."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.errors import CheckpointError
from blockspec.models.dflash import load_dflash_model, save_dflash_model, select_target_layers
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
                             head_dim=16, vocab=320, target_layers=4, layer_ids=(1, 1)):
    """A checkpoint as the public drafts ship it: written by hand, not by save_pretrained."""
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
            f"layers.{i}.mlp.gate_proj.weight": (2 * hidden, hidden), f"layers.{i}.mlp.up_proj.weight": (2 * hidden, hidden),
            f"layers.{i}.mlp.down_proj.weight": (hidden, 2 * hidden),
        })
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
    ("not_dflash", "not a DFlash draft"),
    ("no_mask", "mask_token_id"),
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
    elif damage in ("not_dflash", "no_mask"):
        config = json.loads(config_path.read_text())
        if damage == "not_dflash":
            config["architectures"] = ["Qwen3ForCausalLM"]
        else:
            del config["dflash_config"]["mask_token_id"]
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
