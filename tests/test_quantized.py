"""--quantize: a target whose linear layers run on fp16 weights (FBGEMM); lossless against its own greedy decoding."""

import pytest
import torch
from torch import nn

from blockspec.cli import main
from blockspec.decoding.compile_policy import compile_choice
from blockspec.decoding.fast import FastForward
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.errors import BlockspecError
from blockspec.models.quantized import Fp16Linear, parameter_count, quantization_of, quantize_target
from helpers import MAX_NEW, TWO_FAMILIES, decode, hf_greedy, make_causal_lm, make_dflash, prompts


@pytest.fixture(scope="module", params=TWO_FAMILIES)
def half_world(request):
    target = quantize_target(make_causal_lm(request.param, vocab_size=320), "fp16")
    return target, [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in prompts(320, count=12, seed=51)]


def test_a_block_of_rows_gives_each_row_what_it_gives_alone():
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    layer = Fp16Linear(linear)
    x = torch.randn(1, 19, 96)
    block = layer(x)
    for width in (1, 2, 5, 16):
        assert torch.equal(layer(x[:, :width]), block[:, :width])
    assert all(torch.equal(layer(x[:, i:i + 1]), block[:, i:i + 1]) for i in range(19))
    # the product is the fp32 product of the fp16-rounded weight
    expected = nn.functional.linear(x, linear.weight.detach().half().float(), linear.bias)
    torch.testing.assert_close(block, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.weight, linear.weight.detach().half().float())


def test_quantizing_replaces_every_linear_and_keeps_the_weights_readable():
    model = make_causal_lm("llama", vocab_size=320)
    count = parameter_count(model)
    head_rows = model.get_output_embeddings().weight.detach().clone()
    quantize_target(model, "fp16")
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, Fp16Linear) and quantization_of(model) == "fp16"
    assert parameter_count(model) == count  # the tied head counts once, as before
    torch.testing.assert_close(model.get_output_embeddings().weight, head_rows.half().float())
    assert quantization_of(make_causal_lm("llama", vocab_size=320)) == "none"


@pytest.mark.parametrize("block_size,tree_budget", [(4, None), (8, None), (8, 12)])
def test_speculative_decoding_of_a_half_precision_target_equals_its_own_greedy_decoding(half_world, block_size,
                                                                                         tree_budget):
    target, references = half_world
    drafter = DFlashDrafter(make_dflash(target, block_size=8), target, packed=True)
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, tree_budget=tree_budget)
    fast = FastForward(target, drafter.feature_layers, compile=False)
    for ids, expected in references:
        assert decode(target, ids, drafter, config).token_ids == expected  # the eager forward
        assert decode(target, ids, drafter, config, fast=fast).token_ids == expected  # the fast path


@pytest.mark.slow
def test_the_compiled_fast_path_runs_the_half_precision_target_losslessly(tmp_path):
    from blockspec.decoding.compile_policy import configure_inductor

    configure_inductor(str(tmp_path / "inductor"))
    target = quantize_target(make_causal_lm("llama", vocab_size=320, num_hidden_layers=2, seed=7), "fp16")
    drafter = DFlashDrafter(make_dflash(target, num_layers=1, block_size=4), target, packed=True)
    fast = FastForward(target, drafter.feature_layers, compile=True)
    config = GenerationConfig(max_new_tokens=40, block_size=4)
    for ids in prompts(320, count=3, seed=53):
        assert decode(target, ids, drafter, config, fast=fast).token_ids == hf_greedy(target, ids, 40)
    assert fast.stats.graphs >= 1


def test_a_quantized_target_counts_its_packed_weights_when_choosing_to_compile():
    model = make_causal_lm("llama", vocab_size=320)
    before = compile_choice(model, "auto")[1]
    assert compile_choice(quantize_target(model, "fp16"), "auto")[1] == before


@pytest.mark.parametrize("mode,message", [
    ("int4", "--quantize int4: int4 has no fast kernel"),
    ("int8", "--quantize int8: int8 with per-token int8 activations is fast here but not lossless"),
    ("q4", "--quantize must be one of none, fp16"),
])
def test_modes_that_cannot_run_are_refused_by_name(mode, message):
    with pytest.raises(BlockspecError, match=message):
        quantize_target(make_causal_lm("llama", vocab_size=320), mode)


def test_a_target_not_in_fp32_is_refused():
    model = make_causal_lm("llama", vocab_size=320).to(torch.bfloat16)
    with pytest.raises(BlockspecError, match="quantizes an fp32 target; this one is torch.bfloat16"):
        quantize_target(model, "fp16")


def test_the_command_line_refuses_a_mode_before_loading_anything(tiny_target_dir, capsys):
    code = main(["generate", "--target", str(tiny_target_dir), "--method", "ar", "--quantize", "int4", "hello"])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("blockspec: error: --quantize int4:") and "Traceback" not in err


def test_generate_runs_a_half_precision_target_as_ar_does(tiny_target_dir, tiny_draft_dir, capsys):
    import json

    common = ["generate", "--target", str(tiny_target_dir), "--max-new-tokens", "12", "--json", "--quantize", "fp16"]
    assert main([*common, "--draft", str(tiny_draft_dir), "--block-size", "4", "What is 12 times 7?"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "ar", "What is 12 times 7?"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == drafted["token_ids"]
