"""The shipped response caches (scripts/data) come from training prompts only, never a test split."""

import gzip
import json
import re
from pathlib import Path

import pytest

from blockspec.training.prompts import MBPP_TEST_IDS, record_id

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "datasets"
CACHES = sorted((ROOT / "scripts" / "data").glob("*.jsonl.gz"))
TRAINING_FILES = {"gsm8k_train", "code_alpaca_2k", "mbpp"}


def cache_ids(path):
    with gzip.open(path, "rt") as rows:
        return [json.loads(line)["id"] for line in rows]


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("cache", CACHES, ids=lambda p: p.name)
def test_shipped_responses_answer_training_prompts_only(cache):
    if not SHARED.is_dir():
        pytest.skip(f"the datasets the caches are checked against are not beside the repo ({SHARED})")
    mbpp_task_ids = [row["task_id"] for row in jsonl(SHARED / "mbpp.jsonl")]
    gsm8k_train = [row["question"] for row in jsonl(SHARED / "gsm8k_train.jsonl")]
    gsm8k_test = {row["question"] for row in jsonl(SHARED / "gsm8k_test.jsonl")}
    ids = cache_ids(cache)
    assert ids and len(set(ids)) == len(ids)
    for prompt_id in ids:
        source, _, row = record_id(prompt_id).rpartition(":")  # a restyled prompt is its record's
        assert source in TRAINING_FILES, prompt_id
        if source == "mbpp":  # ids name rows of the file; the test split is task_id 11..510
            assert mbpp_task_ids[int(row)] not in MBPP_TEST_IDS, prompt_id
        if source == "gsm8k_train":
            assert gsm8k_train[int(row)] not in gsm8k_test, prompt_id


def test_the_shipped_caches_do_not_overlap():
    seen = set()
    for cache in CACHES:
        ids = set(cache_ids(cache))
        assert not ids & seen, cache.name
        seen |= ids


def test_the_guide_restores_exactly_the_shipped_caches_each_with_its_meta():
    guide = (ROOT / "docs" / "shipped-drafters.md").read_text()
    loop = re.search(r"for f in (.*?); do", guide, flags=re.S).group(1)
    restored = {name for name in re.split(r"[\s\\#]+", loop) if name}
    assert restored == {path.name.removesuffix(".jsonl.gz") for path in CACHES}
    for cache in CACHES:
        meta = json.loads(cache.with_name(cache.name.replace(".gz", ".meta.json")).read_text())
        assert meta["format"] == "blockspec-responses", cache.name
