"""Build the bundled code-editing prompt set: a given solution to change, where most of the answer is copied text.

Each prompt gives an MBPP reference solution (test split, task ids 11..510) or a HumanEval canonical
solution with its signature, and asks for one edit that leaves most of the code as it is: rename the
function, add a docstring, add type hints, or add comments. Run once; the output is bundled:

    .venv/bin/python scripts/build_code_edit_set.py --data-dir ../shared/datasets \
        --out blockspec/data/prompts/code_edit.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

from blockspec.data.benchmarks import MBPP_TEST_IDS

EDITS = [
    "Rename the function `{name}` to `{new_name}` everywhere and return the whole code, unchanged otherwise.",
    "Add a docstring to `{name}` that says what it returns, and return the whole code, unchanged otherwise.",
    "Add Python type hints to the signature of `{name}` and return the whole code, unchanged otherwise.",
    "Add a short comment above each line of `{name}` that is not obvious, and return the whole code.",
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/datasets")
    parser.add_argument("--out", default="blockspec/data/prompts/code_edit.jsonl")
    parser.add_argument("--per-source", type=int, default=30)
    return parser.parse_args()


def mbpp_solutions(data_dir: Path, count: int):
    rows = [json.loads(line) for line in (data_dir / "mbpp.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        if row["task_id"] in MBPP_TEST_IDS and count > 0:
            code = row["code"].replace("\r\n", "\n").replace("\t", "    ").strip()
            if _function_name(code):
                count -= 1
                yield f"mbpp/{row['task_id']}", code


def humaneval_solutions(data_dir: Path, count: int):
    with gzip.open(data_dir / "humaneval.jsonl.gz", "rt") as lines:
        for line in lines:
            if count <= 0:
                return
            row = json.loads(line)
            count -= 1
            yield row["task_id"], (row["prompt"] + row["canonical_solution"]).strip()


def _function_name(code: str) -> str | None:
    match = re.search(r"^def (\w+)\(", code, flags=re.MULTILINE)
    return match.group(1) if match else None


def main() -> None:
    args = parse_args()
    data_dir = Path(args.data_dir)
    sources = list(mbpp_solutions(data_dir, args.per_source)) + list(humaneval_solutions(data_dir, args.per_source))
    rows = []
    for index, (source, code) in enumerate(sources):
        name = _function_name(code)
        edit = EDITS[index % len(EDITS)].format(name=name, new_name=f"{name}_v2")
        prompt = f"Here is some Python code:\n```python\n{code}\n```\n{edit}"
        rows.append({"id": f"code_edit/{index}", "dataset": "code_edit", "source": source, "turns": [prompt]})
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
