"""`blockspec export`: drafts in vLLM's speculators layout and the public one, loaded back identically; what an
engine cannot run is refused by name."""

import json

import pytest
import torch

from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.drafters.eagle3_mtp import RecursiveDrafter
from blockspec.drafters.registry import detect_method
from blockspec.errors import CheckpointError
from blockspec.models.dflash.checkpoint import load_dflash_model, save_dflash_model
from blockspec.models.eagle3 import load_eagle3_model
from blockspec.models.export import export_draft
from helpers import decode, make_causal_lm, make_dflash, make_recursive, prompts


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    target = make_causal_lm("qwen3", vocab_size=320).double()
    save_dflash_model(make_dflash(target, num_layers=2, block_size=8), root / "dflash")
    make_recursive("eagle3", target, draft_vocab_size=120).save_pretrained(root / "eagle3")
    return target, root


def same_weights(a, b):
    assert a.state_dict().keys() == b.state_dict().keys()
    for name, tensor in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], tensor), name


@pytest.mark.parametrize("to", ["vllm", "speculators", "hf"])
def test_an_exported_dflash_draft_loads_back_and_drafts_identically(drafts, tmp_path, to):
    target, root = drafts
    out = export_draft(root / "dflash", to, tmp_path / "out", verifier="tiny-target")
    config = json.loads((out / "config.json").read_text())
    if to != "hf":
        assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [2, 2]
        assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    assert detect_method(out) == "dflash"
    ours, theirs = load_dflash_model(root / "dflash"), load_dflash_model(out)
    same_weights(ours, theirs)
    ids = prompts(320, count=1, seed=4)[0]
    runs = [decode(target, ids, DFlashDrafter(model, target), GenerationConfig(max_new_tokens=16))
            for model in (ours, theirs)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats.acceptance_lengths == runs[1].stats.acceptance_lengths


def test_an_exported_eagle3_draft_loads_back_and_drafts_identically(drafts, tmp_path):
    target, root = drafts
    out = export_draft(root / "eagle3", "vllm", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    ours, theirs = load_eagle3_model(root / "eagle3"), load_eagle3_model(out)
    same_weights(ours, theirs)
    ids = prompts(320, count=1, seed=5)[0]
    runs = [decode(target, ids, RecursiveDrafter(model, target, name="eagle3"), GenerationConfig(max_new_tokens=16))
            for model in (ours, theirs)]
    assert runs[0].token_ids == runs[1].token_ids


def test_a_draft_reading_the_last_layer_after_the_final_norm_is_refused_for_engines(drafts, tmp_path):
    _, root = drafts
    draft = tmp_path / "last-layer"
    draft.mkdir()
    config = json.loads((root / "dflash" / "config.json").read_text())
    config["num_target_layers"] = 2  # target layer 1 is then the last one
    (draft / "config.json").write_text(json.dumps(config))
    (draft / "model.safetensors").write_bytes((root / "dflash" / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"last layer after its final norm .*hidden_states\[2\]"):
        export_draft(draft, "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert export_draft(draft, "hf", tmp_path / "copy").is_dir()  # the public layout carries it as it is


@pytest.mark.parametrize("to,message", [("gguf", "convert_hf_to_gguf.py"), ("sglang", "no SGLang"),
                                        ("onnx", "--to must be one of vllm, speculators, hf")])
def test_formats_blockspec_does_not_write_are_refused_with_the_reason(drafts, tmp_path, to, message):
    _, root = drafts
    with pytest.raises(CheckpointError, match=message):
        export_draft(root / "dflash", to, tmp_path / "out")


def test_an_existing_output_is_kept_unless_forced(drafts, tmp_path, capsys):
    from blockspec.cli import main

    _, root = drafts
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("work")
    assert main(["export", str(root / "dflash"), "--to", "vllm", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert main(["export", str(root / "dflash"), "--to", "vllm", "--out", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
