"""benchmarks/recipe_sweep.py: short runs scored by exact block acceptance on held-out responses."""

import json
import runpy
import sys

import pytest

from helpers import first_response_cache


def sweep(monkeypatch, target_dir, cache, results, name, steps):
    monkeypatch.setattr(sys, "argv", ["recipe_sweep.py", "--name", name, "--target", str(target_dir),
                                      "--cache", str(cache), "--held-out", "4", "--anchors-scored", "8",
                                      "--steps", str(steps), "--block-size", "4", "--anchors-per-sequence", "4",
                                      "--lr", "3e-3", "--out", str(results.parent / "runs"), "--results", str(results)])
    runpy.run_path("benchmarks/recipe_sweep.py", run_name="__main__")
    return json.loads(results.read_text().splitlines()[-1])


@pytest.mark.slow
def test_a_trained_drafter_scores_above_an_untrained_one_on_held_out_responses(learned_target, tmp_path,
                                                                               monkeypatch):
    _, target_dir, _ = learned_target
    cache = first_response_cache(learned_target, tmp_path)
    results = tmp_path / "results.jsonl"
    untrained = sweep(monkeypatch, target_dir, cache, results, "untrained", 1)
    trained = sweep(monkeypatch, target_dir, cache, results, "trained", 80)
    assert 1.0 <= untrained["held_out_tau"] < trained["held_out_tau"] <= 4.0
    assert len(trained["accepted_given_reached"]) == 3
    assert [json.loads(line)["name"] for line in results.read_text().splitlines()] == ["untrained", "trained"]


def test_the_held_out_responses_never_train(learned_target, tmp_path):
    split = runpy.run_path("benchmarks/recipe_sweep.py")["split"]
    cache = first_response_cache(learned_target, tmp_path)
    held_out, training = split([str(cache), str(cache)], 4)
    held_ids = {s.id for s in held_out}
    assert len(held_ids) == 4 and not held_ids & {s.id for s in training}
    assert len(training) == 2 * (len(cache.read_text().splitlines()) - 4)
    assert [s.id for s in split([str(cache)], 4)[0]] == [s.id for s in held_out]  # a fixed draw
