"""The prompt subsets bundled in the package, and prompt files."""

import json
from importlib import resources

import pytest

from blockspec.bench.datasets import BUNDLED, load_bundled, load_prompt_file
from blockspec.errors import BlockspecError

EXPECTED_ROWS = {"gsm8k": 100, "humaneval": 50, "math500": 50, "mbpp": 50, "mt_bench": 20, "code_edit": 60}
GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def test_bundled_files_are_package_resources():
    package = resources.files("blockspec.data.prompts")
    assert package.joinpath("README.md").is_file()
    assert set(BUNDLED) == set(EXPECTED_ROWS)
    for name in BUNDLED:
        assert package.joinpath(f"{name}.jsonl").is_file()


@pytest.mark.parametrize("name", sorted(EXPECTED_ROWS))
def test_every_bundled_set_loads_with_its_count_and_fields(name):
    rows = load_bundled(name)
    assert len(rows) == EXPECTED_ROWS[name]
    assert len({row["id"] for row in rows}) == len(rows)
    for row in rows:
        assert row["dataset"] == name
        assert isinstance(row["turns"], list) and all(isinstance(t, str) and t.strip() for t in row["turns"])
        assert len(row["turns"]) == (2 if name == "mt_bench" else 1)
        if name in ("gsm8k", "math500"):
            assert isinstance(row["answer"], str) and row["answer"]
        else:
            assert "answer" not in row
    assert load_bundled(name, limit=3) == rows[:3]


def test_gsm8k_uses_the_reference_prompt_format():
    rows = load_bundled("gsm8k")
    assert rows[0]["turns"][0].startswith("Janet’s ducks lay 16 eggs per day.")
    assert rows[0]["answer"] == "18"
    for row in rows:
        assert row["turns"][0].endswith(GSM8K_SUFFIX)
        assert row["turns"][0].count("\n") == 1
        assert row["answer"].lstrip("-").isdigit()


def test_other_reference_formats():
    humaneval = load_bundled("humaneval")[0]
    assert humaneval["id"] == "HumanEval/0"
    assert humaneval["turns"][0].startswith(
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n")
    assert humaneval["turns"][0].endswith("\n```")
    assert all(row["turns"][0].endswith("within \\boxed{}.") for row in load_bundled("math500"))
    mbpp_ids = [int(row["id"].split("/")[1]) for row in load_bundled("mbpp")]
    assert mbpp_ids == list(range(11, 61))
    assert load_bundled("mt-bench", limit=1)[0]["id"] == "mt_bench/81"  # the hyphenated name works too


def test_unknown_bundled_name_is_a_clear_error():
    with pytest.raises(BlockspecError, match="unknown bundled prompt set 'nope'.*gsm8k"):
        load_bundled("nope")


def test_prompt_files_with_turns_or_a_text_field(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in [
        {"turns": ["first", "second"], "id": 7},
        {"prompt": "a prompt", "answer": "42"},
        {"question": "a question"},
        {"text": "a text", "task_id": 12},
    ]) + "\n\n")
    rows = load_prompt_file(path)
    assert [row["turns"] for row in rows] == [["first", "second"], ["a prompt"], ["a question"], ["a text"]]
    assert [row["id"] for row in rows] == [7, "mine/1", "mine/2", 12]
    assert rows[1]["answer"] == "42" and all(row["dataset"] == "mine" for row in rows)
    assert len(load_prompt_file(path, limit=2)) == 2


@pytest.mark.parametrize("content,message", [
    ("not json\n", "line 1 is not valid JSON"),
    ('{"turns": ["ok"]}\n[1, 2]\n', "line 2 is a JSON list"),
    ('{"answer": "1"}\n', "has none of the fields 'turns', 'prompt'"),
    ('{"turns": []}\n', "'turns' must be a non-empty list"),
    ('{"prompt": 3}\n', "'prompt' must be a non-empty string"),
    ("\n\n", "holds no prompts"),
])
def test_bad_prompt_files_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(BlockspecError, match=message):
        load_prompt_file(path)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(BlockspecError, match="does not exist"):
        load_prompt_file(tmp_path / "absent.jsonl")
