"""The DFlash drafter denoising its block in K passes: the schedule, the passes, losslessness."""

import json

import pytest
import torch

from blockspec.bench.methods import MethodName, build_methods, parse_method_name
from blockspec.cli import main
from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter, denoise_schedule
from blockspec.drafters.registry import build_drafter
from blockspec.errors import BlockspecError
from blockspec.models.target import load_target, position_ids
from blockspec.sampling import SamplingConfig
from helpers import (
    MAX_NEW,
    PASS,
    PROMPT,
    SAMPLES,
    VOCAB,
    chi_square_pvalue,
    exact_joint,
    hf_greedy,
    make_causal_lm,
    make_dflash,
    prompts,
    small_target,
)


@pytest.mark.parametrize("num_tokens,steps,expected", [
    (15, 1, [15]), (15, 2, [8, 7]), (15, 4, [4, 4, 4, 3]), (7, 3, [3, 2, 2]), (8, 4, [2, 2, 2, 2]),
    (3, 8, [1, 1, 1]), (1, 4, [1]), (0, 2, []),
])
def test_schedule_spreads_the_block_evenly_over_the_passes(num_tokens, steps, expected):
    assert denoise_schedule(num_tokens, steps) == expected


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_denoise_steps_must_be_a_whole_number_of_passes(steps):
    target = make_causal_lm("qwen3")
    with pytest.raises(BlockspecError, match="denoise_steps must be a whole number >= 1"):
        DFlashDrafter(make_dflash(target), target, denoise_steps=steps)


def started_drafter(target, steps, prompt_length=6, block_size=16):
    drafter = DFlashDrafter(make_dflash(target, block_size=block_size), target, denoise_steps=steps)
    features = torch.randn(1, prompt_length, len(drafter.feature_layers) * target.config.hidden_size,
                           generator=torch.Generator().manual_seed(0), dtype=target.dtype)
    state = drafter.start(torch.zeros(1, prompt_length, dtype=torch.long), features)
    return drafter, state, features


@pytest.mark.parametrize("steps", [2, 3, 4, 15, 20])
def test_each_pass_commits_the_scheduled_tokens_and_context_enters_the_cache_once(steps):
    target = make_causal_lm("qwen3")
    drafter, state, _ = started_drafter(target, steps)
    passes = []
    drafter.model.register_forward_pre_hook(lambda module, args: passes.append((args[0], args[2])))
    inputs = []
    hook = drafter.embed_tokens.register_forward_hook(lambda module, args, out: inputs.append(args[0][0, 1:].clone()))
    with torch.inference_mode():
        logits = drafter.draft_logits(state, last_token=5, num_tokens=15)
    hook.remove()
    schedule = denoise_schedule(15, steps)
    assert len(passes) == len(inputs) == len(schedule)
    assert passes[0][1] is not None and all(context is None for _, context in passes[1:])
    assert state.cache.length == 6
    still_masked = [int((ids == drafter.mask_token_id).sum()) for ids in inputs]
    assert still_masked == [15 - sum(schedule[:i]) for i in range(len(schedule))]
    final = inputs[-1]
    committed_last = final == drafter.mask_token_id
    assert torch.equal(logits[~committed_last].argmax(-1), final[~committed_last])


def test_one_pass_is_todays_single_forward_bit_for_bit():
    target = make_causal_lm("qwen3")
    drafter, state, features = started_drafter(target, 1)
    model, cache = drafter.model, drafter.model.new_cache()

    def one_forward(last_token, context, context_start, start):
        ids = torch.full((1, 8), drafter.mask_token_id)
        ids[0, 0] = last_token
        hidden = model(drafter.embed_tokens(ids), position_ids(start, 8, "cpu"), context,
                       position_ids(context_start, start - context_start, "cpu"), cache)
        return target.get_output_embeddings()(hidden[0, 1:]).float()

    more = torch.randn(1, 3, features.shape[-1], generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        first = drafter.draft_logits(state, 5, 7)
        drafter.commit(state, torch.tensor([[5, 6, 7]]), more)
        second = drafter.draft_logits(state, 9, 7)
        assert torch.equal(first, one_forward(5, features, 0, 6))
        assert torch.equal(second, one_forward(9, more, 6, 9))


@pytest.fixture(scope="module")
def target_and_references():
    target = make_causal_lm("qwen3", vocab_size=320, seed=2).double()
    return target, [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in prompts(320, count=8, seed=3)]


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, "n"])
def test_denoised_greedy_equals_plain_greedy(target_and_references, block_size, steps):
    target, references = target_and_references
    steps = block_size - 1 if steps == "n" else steps
    drafter = DFlashDrafter(make_dflash(target, block_size=16), target, denoise_steps=steps)
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size)
    for ids, expected in references:
        stream = speculative_generate(target, ids, drafter, config)
        list(stream)
        assert stream.token_ids == expected
        assert all(1 <= n <= block_size for n in stream.stats.acceptance_lengths)


def test_a_tree_from_denoised_passes_equals_plain_greedy(target_and_references):
    target, references = target_and_references
    drafter = DFlashDrafter(make_dflash(target, block_size=16), target, denoise_steps=3)
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=8, tree_budget=12)
    for ids, expected in references:
        stream = speculative_generate(target, ids, drafter, config)
        list(stream)
        assert stream.token_ids == expected


def test_denoised_drafts_are_deterministic_when_sampling():
    target = small_target()
    drafter = DFlashDrafter(make_dflash(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, seed=5),
                            target, denoise_steps=2)
    state = drafter.start(PROMPT, torch.randn(1, 3, len(drafter.feature_layers) * target.config.hidden_size))
    passes = []
    drafter.model.register_forward_pre_hook(lambda module, args: passes.append(1))
    proposal = drafter.propose(state, 4, 3, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert proposal.probs is None and proposal.confidence is not None
    assert len(passes) == 2


def sampled_first_tokens(target, drafter, sampling, samples):
    """Counts of the first 3 tokens of 4-token generations, whose first step drafts 2 tokens
    (test_sampling's 3-token generations leave room for one draft only)."""
    counts = {}
    for seed in range(samples):
        config = GenerationConfig(max_new_tokens=4, block_size=3, temperature=sampling.temperature, seed=seed)
        stream = speculative_generate(target, PROMPT, drafter, config)
        list(stream)
        assert stream.stats.drafted[0] == 2
        key = tuple(stream.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.slow
def test_denoised_sampling_matches_target_sampling():
    target = small_target()
    drafter = DFlashDrafter(make_dflash(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, seed=5),
                            target, denoise_steps=2)
    sampling = SamplingConfig(temperature=1.0)
    probs = {k: v for k, v in exact_joint(target, sampling).items() if v > 0}
    counts = sampled_first_tokens(target, drafter, sampling, SAMPLES)
    assert chi_square_pvalue(counts, probs, SAMPLES) > PASS


# --- the command line and the benchmark ----------------------------------------------------

def test_generate_with_denoise_steps_equals_plain_decoding(tiny_target_dir, tiny_draft_dir, capsys):
    outputs = []
    for extra in (["--method", "ar"], ["--draft", str(tiny_draft_dir), "--denoise-steps", "3"]):
        assert main(["generate", "--target", str(tiny_target_dir), *extra, "--max-new-tokens", "20",
                     "--json", "Write a function"]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("args,message", [
    (["--method", "ngram", "--denoise-steps", "2"], "--denoise-steps is for the dflash drafter"),
    (["--method", "ar", "--denoise-steps", "2"], "--denoise-steps is for the dflash drafter"),
    (["--draft", "DRAFT", "--denoise-steps", "0"], "denoise_steps must be a whole number >= 1"),
])
def test_bad_denoise_steps_are_one_clear_line(tiny_target_dir, tiny_draft_dir, args, message, capsys):
    args = [str(tiny_draft_dir) if a == "DRAFT" else a for a in args]
    assert main(["generate", "--target", str(tiny_target_dir), *args, "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: ") and message in err


@pytest.mark.parametrize("name,expected", [
    ("dflash", MethodName("dflash")),
    ("dflash/d2", MethodName("dflash", None, 2)),
    ("dflash@8/d4", MethodName("dflash", "8", 4)),
    ("dflash@t32/d2", MethodName("dflash", "t32", 2)),
    ("dflash@auto", MethodName("dflash", "auto")),
    ("dflash/d1", MethodName("dflash")),
    ("hf-prompt-lookup", MethodName("hf-prompt-lookup")),
])
def test_method_names_with_denoising_passes(name, expected):
    assert parse_method_name(name) == expected


def test_the_drafter_key_names_its_passes():
    assert parse_method_name("dflash@16/d4").drafter == "dflash/d4"
    assert parse_method_name("dflash@16/d1").drafter == parse_method_name("dflash").drafter == "dflash"


@pytest.mark.parametrize("name,message", [
    ("dflash/d0", "after '/' give d and the denoising passes >= 1"),
    ("dflash/2", "after '/' give d"),
    ("dflash/dx", "after '/' give d"),
    ("eagle3/d2", "only dflash denoises"),
])
def test_bad_denoising_suffixes_are_refused(name, message):
    with pytest.raises(BlockspecError, match=message):
        parse_method_name(name)


def test_bench_methods_run_their_own_drafters(tiny_target_dir, tiny_draft_dir):
    target = load_target(str(tiny_target_dir), device="cpu")
    drafters = {"dflash": build_drafter("dflash", target, str(tiny_draft_dir)),
                "dflash/d2": build_drafter("dflash", target, str(tiny_draft_dir), denoise_steps=2)}
    methods = build_methods(["ar", "dflash", "dflash/d2", "dflash@4/d2", "dflash@t8/d2"], target, drafters=drafters)
    assert [m.drafter and m.drafter.denoise_steps for m in methods] == [None, 1, 2, 2, 2]
    assert [(m.block_size, m.tree_budget) for m in methods[2:]] == [(None, None), (4, None), (None, 8)]


def test_bench_compares_denoising_passes_side_by_side(tiny_target_dir, tiny_draft_dir, tmp_path, capsys):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"id": "a/0", "dataset": "a", "turns": ["the cat sat on the mat"]}) + "\n")
    code = main(["bench", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir),
                 "--methods", "ar,dflash,dflash/d2,dflash@auto/d3", "--datasets", str(prompts_file),
                 "--max-new-tokens", "8", "--warmup-tokens", "0", "--no-chat-template", "--no-progress",
                 "--out", str(tmp_path / "out")])
    assert code == 0  # a greedy run: every method's tokens equal ar's
    table = capsys.readouterr().out
    for method in ("ar", "dflash", "dflash/d2", "dflash@auto/d3"):
        assert f"| a | {method} |" in table
    curves = json.loads((tmp_path / "out" / "calibration.json").read_text())
    assert [label.split()[0] for label in curves] == ["dflash/d3"]
