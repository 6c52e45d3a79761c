"""Adaptive verify width: lossless, calibrated against acceptance, and choosing by the cost model."""

import json
import random
from dataclasses import replace

import pytest
import torch

from blockspec.cli import main
from blockspec.decoding.costs import COST_CACHE_MAX_AGE_S, CostModel, cost_model_for
from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.policy import PROBE_AT_MOST, PROBE_EVERY, AcceptanceCalibrator, AdaptiveWidth, WidthPolicies
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.drafters.draft_lm import DraftModelDrafter
from blockspec.drafters.eagle3_mtp import RecursiveDrafter
from blockspec.drafters.ngram import PromptLookupDrafter
from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingConfig
from helpers import (
    MAX_NEW,
    PASS,
    SAMPLES,
    TWO_FAMILIES,
    VOCAB,
    FixedCosts,
    chi_square_pvalue,
    decode,
    exact_joint,
    hf_greedy,
    make_causal_lm,
    make_dflash,
    make_recursive,
    perturbed_copy,
    prompts,
    repetitive_prompts,
    sampled_joint,
    small_target,
)


@pytest.fixture(autouse=True)
def private_cost_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_HOME", str(tmp_path / "home"))


def run(target, ids, drafter, block_size, width_policies=None):
    return decode(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size),
                  width_policies=width_policies)


@pytest.fixture(scope="module", params=TWO_FAMILIES)
def world(request):
    target = make_causal_lm(request.param, vocab_size=320).double()
    cases = prompts(320, count=10, seed=21) + repetitive_prompts(320, 10, seed=22)
    return target, [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in cases]


def make_drafter(kind, target):
    if kind == "dflash":
        model = make_dflash(target, block_size=8)
        with torch.no_grad():  # confident (if mostly wrong) drafts, so that the chosen width varies
            model.norm.weight.mul_(20.0)
        return DFlashDrafter(model, target)
    if kind == "eagle3":
        model = make_recursive("eagle3", target)
        with torch.no_grad():
            model.norm.weight.mul_(20.0)
        return RecursiveDrafter(model, target, name="eagle3", block_size=6)
    if kind == "draft":
        return DraftModelDrafter(perturbed_copy(target), target, block_size=6)
    return PromptLookupDrafter(block_size=6)


def mid_width_costs(max_width):
    """Costs under which the width that pays depends on the draft's confidence."""
    return FixedCosts([1.0 + 0.03 * w for w in range(max_width)])


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "draft", "ngram"])
def test_auto_width_is_lossless_and_varies(world, kind):
    target, references = world
    policies = WidthPolicies(lambda model, width: mid_width_costs(width))
    drafter = make_drafter(kind, target)
    widths = set()
    for ids, expected in references:
        stream = run(target, ids, drafter, "auto", policies)
        assert stream.token_ids == expected
        assert all(1 <= n <= stream.sequence.block_size for n in stream.stats.acceptance_lengths)
        chosen = stream.widths  # one per step that had drafts to cut
        assert [w for w in chosen if w > 1] == [d + 1 for d in stream.stats.drafted if d > 0]
        widths.update(chosen)
    assert len(widths) > 1, widths


def test_a_seeded_sampled_decode_repeats_whatever_the_policy_has_learnt(world):
    target, references = world
    policies = WidthPolicies(lambda model, width: mid_width_costs(width))
    drafter = make_drafter("dflash", target)
    ids = references[0][0]
    seeded = GenerationConfig(max_new_tokens=MAX_NEW, block_size="auto", temperature=0.9, seed=7)
    first = decode(target, ids, drafter, seeded, width_policies=policies)
    for other, _ in references[1:6]:  # the policy learns from other prompts in between
        run(target, other, drafter, "auto", policies)
    again = decode(target, ids, drafter, seeded, width_policies=policies)
    assert again.token_ids == first.token_ids
    assert again.sequence.width_policy is None and again.sequence.block_size == 8  # the widest, every step
    unseeded = decode(target, ids, drafter, replace(seeded, seed=None), width_policies=policies)
    assert unseeded.sequence.width_policy is not None  # an unseeded one adapts; so does a greedy one


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "draft"])
def test_a_sampled_drafts_confidences_do_not_depend_on_its_draws(world, kind):
    """Were the width chosen from q(drawn token), whether a draft is verified would follow the draw: biased."""
    target, references = world
    drafter = make_drafter(kind, target)
    drafter.sample_drafts = True
    sampling = SamplingConfig(temperature=1.0)
    confidences, tokens = [], []
    for seed in (1, 2, 3):  # a fresh state each time: proposing moves it
        state = decode(target, references[0][0], drafter, GenerationConfig(max_new_tokens=1)).sequence.draft_state
        proposal = drafter.propose(state, 7, 5, sampling, torch.Generator().manual_seed(seed))
        confidences.append(proposal.confidences())
        tokens.append(proposal.tokens.tolist())
    assert len({tuple(t) for t in tokens}) > 1  # the draws differ
    if kind == "dflash":  # one pass gives every position's q before any draw: its peak
        assert confidences[0] == confidences[1] == confidences[2] and all(0 < c <= 1 for c in confidences[0])
    else:  # each q follows the draws before it: no confidence, the width stays fixed
        assert confidences == [None, None, None]


def test_an_unseeded_sampled_decode_repeats_after_torch_manual_seed(world):
    target, references = world
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=4, temperature=1.0)
    drafter = make_drafter("dflash", target)
    outputs = []
    for _ in range(2):
        torch.manual_seed(3)
        outputs.append(decode(target, references[0][0], drafter, config).token_ids)
    assert outputs[0] == outputs[1]


def test_auto_needs_a_drafter_and_other_values_are_refused():
    target = make_causal_lm("llama", vocab_size=320)
    with pytest.raises(BlockspecError, match="'auto' needs a drafter"):
        speculative_generate(target, torch.tensor([[5, 6]]), None, GenerationConfig(block_size="auto"))
    with pytest.raises(BlockspecError, match="whole number >= 1 or 'auto'"):
        GenerationConfig(block_size="big")
    with pytest.raises(BlockspecError, match=">= 1 or 'auto'"):
        GenerationConfig(block_size=0)


def test_the_calibration_converges_to_the_true_acceptance():
    """A synthetic drafter whose draft k is accepted with probability conf**2 (a chain's verdicts, as the
    policy learns from them)."""
    rng = random.Random(0)
    policy = AdaptiveWidth(CostModel([1.0] * 7))
    calibrator = policy.calibrator
    for _ in range(20000):
        confidences = [rng.random() for _ in range(6)]
        accepted = 0
        while accepted < 6 and rng.random() < confidences[accepted] ** 2:
            accepted += 1
        policy.observe(confidences, None, list(range(accepted)))
    for confidence in (0.15, 0.35, 0.55, 0.75, 0.95):
        low = int(confidence * 20) / 20  # the bin's mean of conf**2
        truth = ((low + 0.05) ** 3 - low ** 3) / 3 / 0.05
        assert calibrator(confidence) == pytest.approx(truth, abs=0.04), confidence
    table = [row["predicted"] for row in calibrator.curve()]
    assert table == sorted(table)  # isotonic


def test_an_uncalibrated_drafter_starts_from_its_own_confidence():
    calibrator = AcceptanceCalibrator()
    assert calibrator(0.925) == pytest.approx(0.925)
    assert calibrator(0.025) == pytest.approx(0.025)


def observe(policy, confidences, accepted, *, verify_seconds, width, draft_seconds):
    """One sequence's step, as ``decode_step`` reports it to the policy."""
    policy.observe(confidences, None, list(range(accepted)))
    policy.observe_step(rows=1, batch=1, width=width, tokens=accepted + 1, draft_seconds=draft_seconds,
                        verify_seconds=verify_seconds)


def test_the_policy_maximises_tokens_per_second():
    costs = CostModel([1.0, 1.1, 1.2, 1.3, 1.4, 1.5])
    sure = AdaptiveWidth(costs)
    assert sure.choose([0.99] * 5) == 6
    unsure = AdaptiveWidth(costs)
    assert unsure.choose([0.02] * 5) == 1
    expensive = AdaptiveWidth(CostModel([1.0, 3.0, 3.1, 3.2]))
    assert expensive.choose([0.6, 0.6, 0.6]) == 1  # 1.6 tokens at 3x the cost does not pay
    assert AdaptiveWidth(CostModel([1.0, 1.05, 1.1, 3.0])).choose([0.9, 0.9, 0.9]) == 3
    policy = AdaptiveWidth(CostModel([1.0, 2.0]))
    observe(policy, [0.5], 1, verify_seconds=4.0, width=2, draft_seconds=0.5)
    assert policy.costs(2) == pytest.approx(2.4) and policy.draft_seconds == 0.5


def test_a_batch_drafts_less_as_it_grows():
    """B rows of w tokens cost one row of B * w here: the more rows, the narrower the width that pays."""
    costs = CostModel([1.0 + 0.1 * w for w in range(16)])
    policy = AdaptiveWidth(costs)
    sure = policy.expected_tokens([0.8] * 15)
    widths = [policy.choose_width([sure] * rows) for rows in (1, 2, 4, 8)]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]
    assert policy.choose_width([[1.0]] * 8) == 1  # no drafts: nothing to choose
    assert policy.choose_width([sure], floor=16) == 16  # a wider row without the policy pays for the forward anyway


@pytest.mark.parametrize("batch, width, expected", [
    (1, 2, 2.0), (4, 2, 6.0), (2, 1, 7 / 3), (3, 3, 17 / 3), (8, 1, 31 / 3), (4, 9, 7.0),
])
def test_batch_costs_are_interpolated_between_measured_row_counts(batch, width, expected):
    costs = CostModel([1.0, 2.0, 3.0], batches={4: [5.0, 6.0, 7.0]})
    assert costs(width, batch) == pytest.approx(expected)


def test_without_batch_measurements_rows_cost_like_width():
    costs = CostModel([1.0, 2.0, 3.0])
    assert costs(2, batch=1) == 2.0 and costs(1, batch=3) == 3.0
    assert costs(2, batch=3) == pytest.approx(6.0)  # past the table: its slope


def test_drafting_pauses_while_it_does_not_pay_and_probes():
    policy = AdaptiveWidth(CostModel([1.0, 1.5]))
    assert policy.should_draft()  # nothing measured yet
    observe(policy, [0.1], 0, verify_seconds=1.5, width=2, draft_seconds=0.5)  # 1 token in 2 s < 1 per s
    decisions = [policy.should_draft() for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1] and decisions[-1]
    for _ in range(20):  # drafting starts to pay: 3 tokens in 2 s
        observe(policy, [0.9, 0.9], 2, verify_seconds=1.5, width=3, draft_seconds=0.5)
    assert all(policy.should_draft() for _ in range(5))


def test_drafting_that_lags_in_a_large_batch_goes_on_in_a_small_one():
    policy = AdaptiveWidth(CostModel([1.0, 1.5]))
    for _ in range(5):  # 8 rows: 8 tokens in 13 s, where a plain step of 8 rows gives 8 in about 5 s
        policy.observe_step(rows=8, batch=8, width=2, tokens=8, draft_seconds=1.0, verify_seconds=12.0)
    assert sorted(policy.speedups) == [8] and policy.speedups[8] < 1
    assert policy.should_draft(batch=1) and policy.should_draft(batch=2)
    assert [policy.should_draft(batch=9) for _ in range(PROBE_EVERY)].count(True) == 1  # 9 rows: the 8s' figure


def test_probes_that_keep_failing_come_ever_more_rarely_until_drafting_pays_again():
    policy = AdaptiveWidth(CostModel([1.0, 1.5]))
    observe(policy, [0.1], 0, verify_seconds=1.5, width=2, draft_seconds=0.5)  # does not pay
    gaps = []
    for _ in range(5):
        steps = 1
        while not policy.should_draft():
            steps += 1
        gaps.append(steps)
        observe(policy, [0.1], 0, verify_seconds=1.5, width=2, draft_seconds=0.5)  # the probe did not pay
    assert gaps == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, PROBE_AT_MOST, PROBE_AT_MOST]
    for _ in range(20):  # drafting pays again: every step drafts, and a later lapse probes at the first gap
        observe(policy, [0.9, 0.9], 2, verify_seconds=0.5, width=3, draft_seconds=0.1)
    assert all(policy.should_draft() for _ in range(5))
    for _ in range(40):
        observe(policy, [0.1], 0, verify_seconds=1.5, width=2, draft_seconds=0.5)
    steps = 1
    while not policy.should_draft():
        steps += 1
    assert steps == PROBE_EVERY


def test_a_stream_stops_drafting_when_it_only_ever_verifies_width_one(world, monkeypatch):
    """Drafting and then verifying no draft costs the draft for nothing: those steps count as drafting
    steps that paid less than plain ones, so the stream drafts again only on its probes."""
    target, references = world

    def wide_never_pays(model, width):
        one_token = cost_model_for(model, width).seconds[0]
        return CostModel([one_token] + [100 * one_token] * (width - 1))

    policies = WidthPolicies(wide_never_pays)
    drafter = make_drafter("dflash", target)
    proposals = []
    propose = drafter.propose
    monkeypatch.setattr(drafter, "propose", lambda *a: proposals.append(1) or propose(*a))
    for index, (ids, expected) in enumerate(references[:4]):
        proposals.clear()
        stream = run(target, ids, drafter, "auto", policies)
        assert stream.token_ids == expected
        # the first prompt drafts (and verifies width 1); later ones probe ever more rarely, maybe not at all
        assert set(stream.widths) == {1} if index == 0 else set(stream.widths) <= {1}
        steps = len(stream.stats.acceptance_lengths)
        assert len(proposals) <= 1 + steps // PROBE_EVERY + 1, (len(proposals), steps)


def test_the_cost_model_is_measured_once_and_cached(tmp_path):
    target = make_causal_lm("llama", vocab_size=320)
    first = cost_model_for(target, 6, cache_dir=tmp_path)
    assert first.max_width == 6 and all(s > 0 for s in first.seconds)

    def no_second_measurement(*args, **kwargs):
        raise AssertionError("measured again")

    assert cost_model_for(target, 4, cache_dir=tmp_path, measure=no_second_measurement).seconds == first.seconds[:4]
    assert len(list(tmp_path.iterdir())) == 1


def test_batch_costs_are_measured_through_the_batch_target_and_cached(tmp_path):
    from blockspec.decoding.batch import BatchTarget
    from blockspec.decoding.costs import batch_grid, width_grid

    assert batch_grid(8) == (1, 2, 4, 8) and batch_grid(6) == (1, 2, 4, 6)
    assert width_grid(17) == [1, 2, 3, 4, 5, 8, 9, 16, 17] and width_grid(1) == [1]
    target = make_causal_lm("llama", vocab_size=320)
    batch = BatchTarget(target, [1], max_batch_size=4)
    costs = batch.cost_model(target, 5)
    assert sorted(costs.batches) == [2, 4] and all(len(t) == 5 and min(t) > 0 for t in costs.batches.values())
    again = batch.cost_model(target, 5)
    assert again.seconds == costs.seconds and again.batches == costs.batches
    assert len(list((tmp_path / "home" / "costs").iterdir())) == 1  # the private home of every test here


def test_a_stale_cost_model_is_measured_again(tmp_path, monkeypatch):
    target = make_causal_lm("llama", vocab_size=320)
    cost_model_for(target, 3, cache_dir=tmp_path)
    (cached,) = tmp_path.iterdir()
    measurements = []

    def counted(*args, **kwargs):
        measurements.append(args)
        return CostModel([0.1, 0.2, 0.3])

    saved = json.loads(cached.read_text())
    saved["measured_at"] -= COST_CACHE_MAX_AGE_S + 1
    cached.write_text(json.dumps(saved))
    assert cost_model_for(target, 3, cache_dir=tmp_path, measure=counted).seconds == [0.1, 0.2, 0.3]
    assert len(measurements) == 1
    assert cost_model_for(target, 3, cache_dir=tmp_path, measure=counted).seconds == [0.1, 0.2, 0.3]  # fresh
    assert len(measurements) == 1

    monkeypatch.setattr(torch, "__version__", "0.0.0-other")  # another torch: another key
    cost_model_for(target, 3, cache_dir=tmp_path, measure=counted)
    assert len(measurements) == 2 and len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.slow
def test_sampling_with_auto_width_follows_the_target():
    target = small_target()
    drafter = DFlashDrafter(make_dflash(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, seed=5), target)
    policies = WidthPolicies(lambda model, width: mid_width_costs(width))
    sampling = SamplingConfig(temperature=1.0)
    probs = {k: v for k, v in exact_joint(target, sampling).items() if v > 0}
    counts = sampled_joint(target, drafter, sampling, SAMPLES, block_size="auto", width_policies=policies)
    assert chi_square_pvalue(counts, probs, SAMPLES) > PASS


def test_cli_takes_auto(tiny_target_dir, tiny_draft_dir, capsys):
    import json

    assert main(["generate", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir), "--block-size",
                 "auto", "--json", "--max-new-tokens", "8", "hello"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) <= 8
    with pytest.raises(SystemExit):
        main(["generate", "--target", str(tiny_target_dir), "--block-size", "wide", "hello"])
    assert "expected a whole number or 'auto'" in capsys.readouterr().err


def test_bench_compares_fixed_and_auto_widths_of_one_drafter(tiny_target_dir, tiny_draft_dir, tmp_path):
    import json

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["hello there", "the quick brown"]))
    out = tmp_path / "bench"
    assert main(["bench", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir), "--datasets",
                 str(prompts_file), "--methods", "dflash@2,dflash@4,dflash@auto,dflash@t6,dflash@t6-auto",
                 "--max-new-tokens", "12",
                 "--out", str(out), "--no-progress", "--warmup-tokens", "2"]) == 0
    summary = json.loads((out / "results.json").read_text())["summary"]
    figures = next(iter(summary.values()))
    assert set(figures) == {"ar", "dflash@2", "dflash@4", "dflash@auto", "dflash@t6", "dflash@t6-auto"}
    assert all(method["mismatches"] == 0 for method in figures.values())
    assert set(figures["dflash@2"]["verify_width_histogram"]) <= {"1", "2"}  # 1: a last step with no room
    assert max(int(w) for w in figures["dflash@auto"]["verify_width_histogram"]) <= 8
    assert max(int(w) for w in figures["dflash@t6"]["verify_width_histogram"]) <= 7  # nodes + the last token
    assert max(int(w) for w in figures["dflash@t6-auto"]["verify_width_histogram"]) <= 7
    assert (out / "verify_widths.png").is_file()
    calibration = json.loads((out / "calibration.json").read_text())
    assert any("chain" in name for name in calibration) and (out / "calibration.png").is_file()
    assert main(["bench", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir), "--datasets",
                 str(prompts_file), "--methods", "dflash@0", "--out", str(out)]) == 2
    assert main(["bench", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir), "--datasets",
                 str(prompts_file), "--methods", "dflash@t6-wide", "--out", str(out)]) == 2
