"""--quantize: a target whose linear layers run on fp16 (FBGEMM), int8 or int4 (llama.cpp's Q8_0 / Q4_1 blocks on
blockspec's kernel) weights; lossless against its own greedy decoding."""

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
from blockspec.models.weight_only import WeightOnlyLinear, kernel_unavailable
from helpers import MAX_NEW, TWO_FAMILIES, decode, hf_greedy, make_causal_lm, make_dflash, prompts

needs_kernel = pytest.mark.skipif(kernel_unavailable() is not None, reason=str(kernel_unavailable()))
MODES = ["fp16", pytest.param("int8", marks=needs_kernel), pytest.param("int4", marks=needs_kernel)]
LAYERS = {"fp16": Fp16Linear, "int8": lambda linear: WeightOnlyLinear(linear, 8),
          "int4": lambda linear: WeightOnlyLinear(linear, 4)}


def reference_weight(linear: nn.Linear, mode: str) -> torch.Tensor:
    """The weight each mode stands for: fp16-rounded, or llama.cpp's own Q8_0 / Q4_1 round trip (gguf's)."""
    weight = linear.weight.detach()
    if mode == "fp16":
        return weight.half().float()
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType.Q8_0 if mode == "int8" else GGMLQuantizationType.Q4_1
    return torch.from_numpy(quants.dequantize(quants.quantize(weight.numpy(), kind), kind))


def _families_and_modes():
    for family in TWO_FAMILIES:
        name, marks = (family.values[0], list(family.marks)) if hasattr(family, "values") else (family, [])
        for mode in ("fp16", "int8", "int4"):
            yield pytest.param((name, mode), marks=marks + ([] if mode == "fp16" else [needs_kernel]),
                               id=f"{name}-{mode}")


@pytest.fixture(scope="module", params=list(_families_and_modes()))
def quantized_world(request):
    family, mode = request.param
    target = quantize_target(make_causal_lm(family, vocab_size=320), mode)
    return target, [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in prompts(320, count=12, seed=51)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("in_features,out_features,bias", [(96, 200, True), (64, 320, False), (32, 7, True),
                                                           (128, 64, False), (576, 1536, False)])
def test_a_block_of_rows_gives_each_row_what_it_gives_alone(mode, in_features, out_features, bias):
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    layer = LAYERS[mode](linear)
    x = torch.randn(1, 19, in_features)
    block = layer(x)
    for width in (1, 2, 3, 4, 5, 6, 7, 12, 16):
        assert torch.equal(layer(x[:, :width]), block[:, :width])
    assert all(torch.equal(layer(x[:, i:i + 1]), block[:, i:i + 1]) for i in range(19))
    # the product is the fp32 product of the weight the mode stands for
    weight = reference_weight(linear, mode)
    assert torch.equal(layer.weight, weight)
    expected = nn.functional.linear(x.double(), weight.double(), None if linear.bias is None else linear.bias.double())
    torch.testing.assert_close(block.double(), expected, rtol=1e-5, atol=1e-5)
    assert layer(x[:, :0]).shape == (1, 0, out_features)


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_a_weight_only_layer_takes_a_gguf_files_own_blocks(bits):
    from gguf import GGMLQuantizationType, quants

    torch.manual_seed(1)
    linear = nn.Linear(64, 48, bias=False)
    kind = GGMLQuantizationType.Q8_0 if bits == 8 else GGMLQuantizationType.Q4_1
    layer = WeightOnlyLinear.from_blocks(quants.quantize(linear.weight.detach().numpy(), kind), bits, 64)
    twin = WeightOnlyLinear(linear, bits)
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), twin(x)) and torch.equal(layer.weight, twin.weight)


@needs_kernel
def test_int8_keeps_a_layer_already_on_a_q4_1_grid_in_its_own_blocks():
    """A checkpoint dequantized from a GGUF file (the embedded default is a Q4_1 file with a Q8_0 head): int8 finds
    the file's own blocks, so the quantized target has the fp32 checkpoint's very weights, in fewer bytes."""
    from gguf import GGMLQuantizationType, quants

    model = make_causal_lm("llama", vocab_size=320)
    on_grid = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            kind = GGMLQuantizationType.Q8_0 if name == "lm_head" else GGMLQuantizationType.Q4_1
            weight = module.weight.detach().numpy()
            module.weight.data = torch.from_numpy(quants.dequantize(quants.quantize(weight, kind), kind))
            on_grid[name] = module.weight.detach().clone()
    quantize_target(model, "int8")
    layers = dict(model.named_modules())
    assert {name: layers[name].bits for name in on_grid} == {name: 8 if name == "lm_head" else 4 for name in on_grid}
    assert all(torch.equal(layers[name].weight, weight) for name, weight in on_grid.items())
    off_grid = quantize_target(make_causal_lm("llama", vocab_size=320), "int8")
    assert {m.bits for m in off_grid.modules() if isinstance(m, WeightOnlyLinear)} == {8}


ISA_SCRIPT = """
import sys, torch
from torch import nn
from blockspec.models.weight_only import WeightOnlyLinear
torch.manual_seed(0)
out = {}
for bits in (8, 4):
    for n, k in ((200, 96), (64, 128), (320, 576)):
        layer = WeightOnlyLinear(nn.Linear(k, n), bits)
        for rows in (1, 3, 5, 6, 7, 13, 16):
            with torch.no_grad():
                out[f"{bits}-{n}-{k}-{rows}"] = layer(torch.randn(rows, k))
torch.save(out, sys.argv[1])
"""


@needs_kernel
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"),
                    reason="the AVX-512 build needs a CPU with AVX-512")
def test_the_avx2_and_avx512_builds_give_the_same_bits(tmp_path):
    """A drafter and its checks can run on either kind of CPU: an output's lane does the same FMAs in both builds."""
    import os
    import subprocess
    import sys

    results = {}
    for isa in ("avx2", "avx512"):
        env = {**os.environ, "BLOCKSPEC_WEIGHT_ONLY_ISA": isa}
        subprocess.run([sys.executable, "-c", ISA_SCRIPT, str(tmp_path / isa)], check=True, env=env, timeout=300)
        results[isa] = torch.load(tmp_path / isa)
    assert results["avx2"].keys() == results["avx512"].keys()
    assert all(torch.equal(results["avx2"][key], results["avx512"][key]) for key in results["avx2"])


@needs_kernel
def test_a_layer_whose_inputs_are_not_in_blocks_of_32_is_refused_by_name():
    with pytest.raises(BlockspecError, match="--quantize int8: a linear layer has 48 input features, not a multiple"):
        WeightOnlyLinear(nn.Linear(48, 64), 8)


@pytest.mark.parametrize("mode", MODES)
def test_quantizing_replaces_every_linear_and_keeps_the_weights_readable(mode):
    model = make_causal_lm("llama", vocab_size=320)
    count = parameter_count(model)
    head = nn.Linear(64, 320, bias=False)
    head.weight.data.copy_(model.get_output_embeddings().weight.detach())
    quantize_target(model, mode)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, (Fp16Linear, WeightOnlyLinear)) and quantization_of(model) == mode
    assert parameter_count(model) == count  # the tied head counts once, as before
    assert torch.equal(model.get_output_embeddings().weight, reference_weight(head, mode))
    assert quantization_of(make_causal_lm("llama", vocab_size=320)) == "none"


@pytest.mark.parametrize("block_size,tree_budget", [(4, None), (8, None), (8, 12)])
def test_speculative_decoding_of_a_quantized_target_equals_its_own_greedy_decoding(quantized_world, block_size,
                                                                                      tree_budget):
    target, references = quantized_world
    drafter = DFlashDrafter(make_dflash(target, block_size=8), target, packed=True)
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, tree_budget=tree_budget)
    fast = FastForward(target, drafter.feature_layers, compile=False)
    for ids, expected in references:
        assert decode(target, ids, drafter, config).token_ids == expected  # the eager forward
        assert decode(target, ids, drafter, config, fast=fast).token_ids == expected  # the fast path


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_the_compiled_fast_path_runs_the_quantized_target_losslessly(tmp_path, mode):
    from blockspec.decoding.compile_policy import configure_inductor

    configure_inductor(str(tmp_path / "inductor"))
    target = quantize_target(make_causal_lm("llama", vocab_size=320, num_hidden_layers=2, seed=7), mode)
    drafter = DFlashDrafter(make_dflash(target, num_layers=1, block_size=4), target, packed=True)
    fast = FastForward(target, drafter.feature_layers, compile=True)
    config = GenerationConfig(max_new_tokens=40, block_size=4)
    for ids in prompts(320, count=3, seed=53):
        assert decode(target, ids, drafter, config, fast=fast).token_ids == hf_greedy(target, ids, 40)
    assert fast.stats.graphs >= 1


@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_target_counts_its_packed_weights_when_choosing_to_compile(mode):
    model = make_causal_lm("llama", vocab_size=320)
    before = compile_choice(model, "auto")[1]
    assert compile_choice(quantize_target(model, mode), "auto")[1] == before


def test_a_mode_that_does_not_exist_is_refused_by_name():
    with pytest.raises(BlockspecError, match="--quantize must be one of none, fp16, int8, int4, got 'q4'"):
        quantize_target(make_causal_lm("llama", vocab_size=320), "q4")


def test_a_target_not_in_fp32_is_refused():
    model = make_causal_lm("llama", vocab_size=320).to(torch.bfloat16)
    with pytest.raises(BlockspecError, match="quantizes an fp32 target; this one is torch.bfloat16"):
        quantize_target(model, "fp16")


def test_the_command_line_refuses_a_mode_before_loading_anything(tiny_target_dir, capsys):
    code = main(["generate", "--target", str(tiny_target_dir), "--method", "ar", "--quantize", "int5", "hello"])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("blockspec: error: --quantize must be one of") and "Traceback" not in err


@pytest.mark.parametrize("mode", MODES)
def test_generate_runs_a_quantized_target_as_ar_does(tiny_target_dir, tiny_draft_dir, capsys, mode):
    import json

    common = ["generate", "--target", str(tiny_target_dir), "--max-new-tokens", "12", "--json", "--quantize", mode]
    assert main([*common, "--draft", str(tiny_draft_dir), "--block-size", "4", "What is 12 times 7?"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "ar", "What is 12 times 7?"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == drafted["token_ids"]
