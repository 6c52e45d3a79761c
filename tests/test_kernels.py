"""Linear kernels chosen by measurement: each shape and row bucket runs MKL (aten) or oneDNN, as timed here."""

import json

import pytest
import torch
import torch.nn.functional as F

from blockspec.decoding.fast import FastForward
from blockspec.errors import BlockspecError
from blockspec.models import packed
from blockspec.models.packed import (
    KERNEL_ENV,
    ROW_BUCKETS,
    KernelPlan,
    PlannedLinear,
    linear_layers,
    module_twin,
    plan_kernels,
    row_bucket,
    shape_key,
)
from helpers import make_causal_lm, prompts

ALTERNATING = tuple("aten" if i % 2 == 0 else "onednn" for i in range(len(ROW_BUCKETS)))


@pytest.fixture(autouse=True)
def measured(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)


@pytest.mark.parametrize("rows,bucket", [(1, 1), (2, 2), (3, 4), (9, 16), (64, 64), (65, 64), (300, 64)])
def test_a_row_count_runs_with_the_bucket_it_rounds_up_to(rows, bucket):
    assert ROW_BUCKETS[row_bucket(rows)] == bucket


@pytest.mark.parametrize("bias", [False, True])
def test_each_bucket_runs_its_planned_kernel_bit_for_bit(bias):
    linear = torch.nn.Linear(48, 80, bias=bias)
    layer = PlannedLinear(linear, ALTERNATING)
    packed_weight = linear.weight.detach().to_mkldnn()
    with torch.inference_mode():
        for rows, kernel in zip(ROW_BUCKETS, ALTERNATING):
            x = torch.randn(1, rows, 48)
            if kernel == "aten":
                expected = F.linear(x, linear.weight, linear.bias)
            else:
                expected = torch.ops.mkldnn._linear_pointwise(x[0], packed_weight, linear.bias, "none", [], "")[None]
            assert torch.equal(layer(x), expected), (rows, kernel)


def test_a_plan_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    model = make_causal_lm("llama", vocab_size=320)
    first = plan_kernels(linear_layers(model), cache_dir=tmp_path)
    shapes = {shape_key(linear) for linear in linear_layers(model)}
    assert set(first.choices) == shapes
    assert all(len(kernels) == len(ROW_BUCKETS) for kernels in first.choices.values())
    assert all(len(first.timings[shape]["aten"]) == len(ROW_BUCKETS) for shape in shapes)
    assert len(list(tmp_path.glob("*.json"))) == len(shapes)

    def must_not_measure(group):
        raise AssertionError("measured again")

    monkeypatch.setattr(packed, "_measure", must_not_measure)
    assert plan_kernels(linear_layers(model), cache_dir=tmp_path).choices == first.choices


def test_a_stale_or_broken_cache_entry_is_measured_again(tmp_path):
    model = make_causal_lm("llama", vocab_size=320)
    plan_kernels(linear_layers(model), cache_dir=tmp_path)
    files = sorted(tmp_path.glob("*.json"))
    files[0].write_text("{not json")
    record = json.loads(files[1].read_text())
    record["measured_at"] -= packed.PLAN_CACHE_MAX_AGE_S + 1
    files[1].write_text(json.dumps(record))
    before = {file: file.stat().st_mtime_ns for file in files[2:]}
    plan_kernels(linear_layers(model), cache_dir=tmp_path)
    assert json.loads(files[0].read_text())["kernels"] and json.loads(files[1].read_text())["measured_at"] > \
        record["measured_at"] + packed.PLAN_CACHE_MAX_AGE_S
    assert {file: file.stat().st_mtime_ns for file in files[2:]} == before


@pytest.mark.parametrize("kernel", ["aten", "onednn"])
def test_the_environment_forces_a_kernel_without_measuring(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, kernel)
    model = make_causal_lm("llama", vocab_size=320)
    plan = plan_kernels(linear_layers(model), cache_dir=tmp_path)
    assert {k for kernels in plan.choices.values() for k in kernels} == {kernel}
    assert plan.tag == kernel and not list(tmp_path.iterdir())


def test_an_unknown_kernel_in_the_environment_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "mkl-packed")
    with pytest.raises(BlockspecError, match=f"{KERNEL_ENV} must be auto, aten or onednn, got 'mkl-packed'"):
        plan_kernels([torch.nn.Linear(4, 4)])


def test_a_mixed_plan_runs_only_the_planned_layers_on_onednn_and_keeps_the_logits():
    model = make_causal_lm("llama", vocab_size=320)
    head = shape_key(model.lm_head)
    plan = KernelPlan({head: ALTERNATING})
    twin = module_twin(model, plan=plan)
    assert isinstance(twin.lm_head, PlannedLinear)
    down, original = twin.model.layers[0].mlp.down_proj, model.model.layers[0].mlp.down_proj
    assert type(down) is torch.nn.Linear and down.weight is original.weight  # dense: its own weight
    assert plan.tag.startswith("mixed-") and "at 2, 8, 32 rows" in plan.describe()
    with torch.inference_mode():
        for ids in prompts(320, count=3, seed=7):
            torch.testing.assert_close(twin(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_the_fast_path_names_its_plan_so_cost_models_of_different_kernels_never_mix(monkeypatch):
    model = make_causal_lm("llama", vocab_size=320)
    paths = set()
    for kernel in ("aten", "onednn"):
        monkeypatch.setenv(KERNEL_ENV, kernel)
        paths.add(FastForward(model, None, compile=False).path)
    assert paths == {"static", "static-onednn"}


# -- a drafter in bf16 where bf16 measures faster ------------------------------------------------------------

def test_bf16_is_timed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    layers = [torch.nn.Linear(64, 256), torch.nn.Linear(256, 64, bias=False)]
    first = packed.bf16_faster(layers, 16, cache_dir=tmp_path)
    monkeypatch.setattr(packed, "_measure_bf16", lambda layers, rows: pytest.fail("measured again"))
    assert packed.bf16_faster(layers, 16, cache_dir=tmp_path) == first
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_without_a_bf16_path_the_drafter_keeps_fp32(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert packed.bf16_faster([torch.nn.Linear(8, 8)], 16, cache_dir=tmp_path) is False
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("vocabulary", [None, 200])
def test_a_bf16_drafter_keeps_the_output_the_targets(vocabulary):
    from blockspec.decoding.sequence import GenerationConfig
    from blockspec.drafters.dflash import DFlashDrafter
    from helpers import decode, hf_greedy, make_dflash

    target = make_causal_lm("qwen3", vocab_size=320)
    vocab = torch.randperm(320, generator=torch.Generator().manual_seed(0))[:vocabulary] if vocabulary else None
    drafter = DFlashDrafter(make_dflash(target, block_size=8), target, draft_vocabulary=vocab,
                            draft_dtype=torch.bfloat16)
    assert drafter.dtype == torch.bfloat16 and next(drafter.model.parameters()).dtype == torch.bfloat16
    for ids in prompts(320, count=8, seed=21):
        assert decode(target, ids, drafter, GenerationConfig(max_new_tokens=24, block_size=8)).token_ids == \
            hf_greedy(target, ids, 24)
    sampled = decode(target, ids, drafter, GenerationConfig(max_new_tokens=24, block_size=8, temperature=0.8, seed=1))
    assert len(sampled.token_ids) == 24


def test_an_unknown_draft_dtype_is_refused_by_name():
    from blockspec.drafters.dflash import DFlashDrafter
    from helpers import make_dflash

    target = make_causal_lm("llama", vocab_size=320)
    with pytest.raises(BlockspecError, match="draft_dtype must be None, 'auto'"):
        DFlashDrafter(make_dflash(target), target, draft_dtype="int8")
