"""Replaying greedy decoding against a recorded answer gives the live loop's acceptance lengths."""

import runpy

import pytest
import torch

from blockspec.bench.replay import replay_acceptance
from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.drafters.ngram import PromptLookupDrafter
from blockspec.errors import BlockspecError
from helpers import MAX_NEW, TWO_FAMILIES, NoisyOracle, hf_greedy, make_causal_lm, make_dflash, prompts


@pytest.fixture(scope="module", params=TWO_FAMILIES)
def world(request):
    target = make_causal_lm(request.param, vocab_size=320).double()
    return target, [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in prompts(320, count=8, seed=5)]


def live_lengths(target, ids, drafter, **config):
    stream = speculative_generate(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW, **config))
    list(stream)
    return stream.token_ids, stream.stats.acceptance_lengths


@pytest.mark.parametrize("tree_budget", [None, 4, 16])
def test_replay_matches_the_live_loop_for_chains_and_trees(world, tree_budget):
    target, references = world
    replayed_any_draft = False
    for ids, answer in references:
        reference = ids[0].tolist() + answer
        tokens, live = live_lengths(target, ids, NoisyOracle(reference, 320, seed=7), block_size=8,
                                    tree_budget=tree_budget)
        assert tokens == answer
        replayed = replay_acceptance(target, NoisyOracle(reference, 320, seed=7), ids[0].tolist(), answer,
                                     block_size=8, tree_budget=tree_budget)
        assert replayed == live
        replayed_any_draft |= max(replayed) > 1
    assert replayed_any_draft


@pytest.mark.parametrize("method", ["dflash", "ngram"])
def test_replay_matches_the_live_loop_for_real_drafters(world, method):
    target, references = world
    for ids, answer in references:
        drafter = DFlashDrafter(make_dflash(target, block_size=8), target) if method == "dflash" \
            else PromptLookupDrafter(block_size=8)
        _, live = live_lengths(target, ids, drafter, block_size=6)
        assert replay_acceptance(target, drafter, ids[0].tolist(), answer, block_size=6) == live
        if method == "dflash":
            _, live_tree = live_lengths(target, ids, drafter, tree_budget=12)
            assert replay_acceptance(target, drafter, ids[0].tolist(), answer, tree_budget=12) == live_tree


def test_replay_refuses_what_the_loop_refuses(world):
    target, references = world
    ids, answer = references[0]
    with pytest.raises(BlockspecError, match="tree replay needs a drafter that proposes token trees"):
        replay_acceptance(target, PromptLookupDrafter(), ids[0].tolist(), answer, tree_budget=8)
    drafter = DFlashDrafter(make_dflash(target, block_size=8), target)
    with pytest.raises(BlockspecError, match="above what dflash drafts"):
        replay_acceptance(target, drafter, ids[0].tolist(), answer, block_size=9)
    with pytest.raises(BlockspecError, match="at least one token"):
        replay_acceptance(target, drafter, ids[0].tolist(), [])


@pytest.mark.parametrize("tree_budget", [None, 16])
def test_replay_of_an_answer_that_stopped_early(world, tree_budget):
    target, references = world
    for ids, full_answer in references:
        eos = full_answer[MAX_NEW // 2]  # a token of the answer serves as its stop token
        answer = hf_greedy(target, ids, MAX_NEW, eos=eos)
        reference = ids[0].tolist() + answer
        tokens, live = live_lengths(target, ids, NoisyOracle(reference, 320, seed=3), block_size=8,
                                    tree_budget=tree_budget, stop_token_ids=(eos,))
        assert tokens == answer and answer[-1] == eos and len(answer) <= MAX_NEW // 2 + 1
        replayed = replay_acceptance(target, NoisyOracle(reference, 320, seed=3), ids[0].tolist(), answer,
                                     max_new_tokens=MAX_NEW, block_size=8, tree_budget=tree_budget)
        assert replayed == live


def test_replay_from_a_bench_run_gives_its_taus(tiny_target_dir, tiny_draft_dir, tmp_path, monkeypatch):
    import json
    import sys

    from blockspec.bench.replay import recorded_answers
    from blockspec.cli import main
    from blockspec.drafters.registry import build_drafter
    from blockspec.models.target import load_target

    out = tmp_path / "run"
    assert main(["bench", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir), "--datasets", "gsm8k",
                 "mt_bench", "--num-prompts", "3", "--max-new-tokens", "10", "--max-turns", "1", "--warmup-tokens",
                 "0", "--methods", "ar,dflash@4,ngram", "--no-progress", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    target = load_target(str(tiny_target_dir), device="cpu")
    answers = recorded_answers(results, target)
    assert [a.dataset for a in answers] == ["gsm8k"] * 3 + ["mt_bench"] * 3
    live = {(r["method"], r["id"]): r["acceptance_lengths"] for r in results["records"]}
    for method, options in (("dflash@4", {"block_size": 4}), ("ngram", {})):
        drafter = build_drafter(method.split("@")[0], target, str(tiny_draft_dir) if "dflash" in method else None)
        for answer in answers:
            assert replay_acceptance(target.model, drafter, answer.prompt_ids, answer.answer_ids,
                                     max_new_tokens=10, **options) == live[(method, answer.id)]

    for record in results["records"]:  # an older run: prompts rebuilt from the data source
        del record["prompt_ids"]
    assert [a.prompt_ids for a in recorded_answers(results, target)] == [a.prompt_ids for a in answers]
    with pytest.raises(BlockspecError, match="needs a greedy run"):
        recorded_answers({**results, "config": {**results["config"], "temperature": 0.7}}, target)

    monkeypatch.setattr(sys, "argv", ["replay_tau.py", str(out / "results.json"), "--draft", str(tiny_draft_dir),
                                      "--widths", "4", "--trees", "8", "--out", str(tmp_path / "tau.json")])
    with pytest.raises(SystemExit) as done:
        runpy.run_path("benchmarks/replay_tau.py", run_name="__main__")
    assert done.value.code == 0
    assert torch.is_grad_enabled(), "the script must not switch autograd off for the rest of the process"
    rows = json.loads((tmp_path / "tau.json").read_text())
    chain = {r["dataset"]: r["tau"] for r in rows if r["setting"] == "chain@4"}
    for dataset in ("gsm8k", "mt_bench"):
        per_answer = [lengths for (method, id_), lengths in live.items()
                      if method == "dflash@4" and id_.startswith(dataset)]
        steps = [n for lengths in per_answer for n in lengths]
        assert chain[dataset] == pytest.approx(sum(steps) / len(steps))
        row = next(r for r in rows if r["setting"] == "chain@4" and r["dataset"] == dataset)
        assert row["first_step"] == pytest.approx(sum(a[0] for a in per_answer) / len(per_answer))
        later = [n for a in per_answer for n in a[1:]]
        assert row["tau_after_first"] == pytest.approx(sum(later) / len(later))
    assert {r["setting"] for r in rows} == {"chain@4", "tree8"}


def test_answer_confidence_scores_each_answer_token_from_its_own_prefix(world):
    target, references = world
    answer_confidence = runpy.run_path("benchmarks/answer_confidence.py")["answer_confidence"]
    ids, answer = references[0]
    chosen, entropy = answer_confidence(target, ids[0].tolist(), answer)
    assert chosen.shape == entropy.shape == (len(answer),)
    for k in (0, len(answer) - 1):
        prefix = torch.cat([ids, torch.tensor([answer[:k]], dtype=torch.long)], 1)
        with torch.no_grad():
            probs = torch.softmax(target(prefix).logits[0, -1], -1)
        assert chosen[k].item() == pytest.approx(probs[answer[k]].item())
        assert chosen[k].item() == pytest.approx(probs.max().item())  # a greedy answer: its token is the top-1
        assert entropy[k].item() == pytest.approx(-(probs * probs.log()).sum().item())
