"""Prompt sets: the small subsets bundled in the package, the full evaluation sets from a
data directory or the hub, and any JSON-lines prompt file.

Every loader returns rows ``{"id", "dataset", "turns": [user messages], ...}``, the turns
already in the DFlash reference benchmark's prompt format; extra fields of the source
(``answer``, ``category``) are kept.
"""

from __future__ import annotations

import gzip
import json
import random
from importlib import resources
from pathlib import Path

from blockspec.data.benchmarks import HUMANEVAL_TEMPLATE, MBPP_TEST_IDS, REASONING_INSTRUCTION
from blockspec.errors import BlockspecError

#: Names of the bundled subsets (files ``blockspec/data/prompts/<name>.jsonl``).
BUNDLED = ("gsm8k", "humaneval", "math500", "mbpp", "mt_bench", "code_edit")

_PROMPT_PACKAGE = "blockspec.data.prompts"
_TEXT_FIELDS = ("prompt", "question", "text")


#: The evaluation sets' files in a data directory (the layout of the offline copies).
DATASET_FILES = {
    "gsm8k": "gsm8k_test.jsonl",
    "math500": "math500.jsonl",
    "humaneval": "humaneval.jsonl.gz",
    "mbpp": "mbpp.jsonl",
    "mt_bench": "mt_bench.jsonl",
}
#: Sets built by the project whose whole content ships with the package (a data directory
#: or the hub has nothing more of them).
WHOLLY_BUNDLED = ("code_edit",)
#: The same sets by their hub names (``datasets.load_dataset`` arguments), for online use.
HUB_DATASETS = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "humaneval": ("openai/openai_humaneval", None, "test"),
    "mbpp": ("google-research-datasets/mbpp", "full", "test"),
    "mt_bench": ("HuggingFaceH4/mt_bench_prompts", None, "train"),
}


def bundled_name(name: str) -> str:
    """The canonical bundled name (``mt-bench`` and ``MT_Bench`` mean ``mt_bench``)."""
    canonical = name.strip().lower().replace("-", "_")
    if canonical not in BUNDLED:
        raise BlockspecError(f"unknown bundled prompt set {name!r}: choose one of {', '.join(BUNDLED)}")
    return canonical


def load_bundled(name: str, limit: int | None = None) -> list[dict]:
    """The first ``limit`` rows (all when None) of a bundled prompt set."""
    name = bundled_name(name)
    resource = resources.files(_PROMPT_PACKAGE).joinpath(f"{name}.jsonl")
    try:
        text = resource.read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as error:
        raise BlockspecError(
            f"the bundled prompt set {name} is missing from the installed package ({error}): reinstall blockspec"
        ) from error
    return _parse_lines(text.splitlines(), f"bundled {name}.jsonl", default_dataset=name, limit=limit)


def load_prompt_file(path, limit: int | None = None) -> list[dict]:
    """Prompts from a JSON-lines file whose rows have ``turns`` or a ``prompt``/``question``/``text`` field."""
    path = Path(path)
    if not path.is_file():
        raise BlockspecError(f"prompt file {path} does not exist" if not path.exists()
                             else f"prompt file {path} is not a file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise BlockspecError(f"prompt file {path} is not UTF-8 text ({error})") from error
    rows = _parse_lines(lines, str(path), default_dataset=path.stem, limit=limit)
    if not rows:
        raise BlockspecError(f"prompt file {path} holds no prompts")
    return rows


def _parse_lines(lines, label: str, *, default_dataset: str, limit: int | None) -> list[dict]:
    if limit is not None and limit < 0:
        raise BlockspecError(f"limit must be >= 0, got {limit}")
    rows: list[dict] = []
    for number, line in enumerate(lines, start=1):
        if limit is not None and len(rows) >= limit:
            break
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as error:
            raise BlockspecError(f"{label} line {number} is not valid JSON ({error.msg}): one JSON object per "
                                 "line") from None
        rows.append(_normalise(raw, f"{label} line {number}", default_dataset, index=len(rows)))
    return rows


def _normalise(raw, where: str, default_dataset: str, index: int) -> dict:
    if not isinstance(raw, dict):
        raise BlockspecError(f"{where} is a JSON {type(raw).__name__}, not an object with a 'turns' or 'prompt' field")
    if "turns" in raw:
        turns = raw["turns"]
        if isinstance(turns, str):
            turns = [turns]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise BlockspecError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    else:
        field = next((f for f in _TEXT_FIELDS if f in raw), None)
        if field is None:
            raise BlockspecError(f"{where} has none of the fields 'turns', {', '.join(repr(f) for f in _TEXT_FIELDS)}")
        if not isinstance(raw[field], str) or not raw[field].strip():
            raise BlockspecError(f"{where}: {field!r} must be a non-empty string")
        turns = [raw[field]]
    row = {
        "id": raw.get("id", raw.get("task_id", raw.get("question_id", f"{default_dataset}/{index}"))),
        "dataset": raw.get("dataset", default_dataset),
        "turns": list(turns),
    }
    row.update((key, value) for key, value in raw.items() if key not in row and key not in _TEXT_FIELDS)
    return row


# --------------------------------------------------------------------------------------
# The full evaluation sets, from their source rows
# --------------------------------------------------------------------------------------


def format_source_row(name: str, raw: dict, index: int) -> dict | None:
    """A source row of an evaluation set as a prompt row in the reference format (None: not a test row)."""
    name = bundled_name(name)
    if name == "gsm8k":
        answer = raw["answer"].split("####")[-1].strip().replace(",", "")
        return {"id": f"gsm8k/{index}", "dataset": name,
                "turns": [raw["question"] + REASONING_INSTRUCTION], "answer": answer}
    if name == "math500":
        prompt = raw.get("prompt") or raw["problem"] + REASONING_INSTRUCTION
        return {"id": f"math500/{index}", "dataset": name, "turns": [prompt], "answer": raw["answer"]}
    if name == "humaneval":
        return {"id": raw["task_id"], "dataset": name, "turns": [HUMANEVAL_TEMPLATE.format(prompt=raw["prompt"])]}
    if name == "mbpp":
        if int(raw["task_id"]) not in MBPP_TEST_IDS:
            return None
        return {"id": f"mbpp/{raw['task_id']}", "dataset": name, "turns": [raw["text"]]}
    turns = raw.get("turns") or raw.get("prompt")
    return {"id": f"mt_bench/{raw['question_id']}", "dataset": name, "category": raw.get("category"),
            "turns": list(turns)}


def load_from_directory(name: str, directory) -> list[dict]:
    """Every test row of an evaluation set from a directory laid out like the offline copies."""
    name = bundled_name(name)
    if name in WHOLLY_BUNDLED:
        return load_bundled(name)
    path = Path(directory) / DATASET_FILES[name]
    if not path.is_file():
        raise BlockspecError(f"{path} does not exist: --data-dir must hold {DATASET_FILES[name]} for {name}")
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                rows.append(_source_row(name, line, f"{path} line {number}", index=number - 1))
    return [row for row in rows if row is not None]


def load_from_hub(name: str) -> list[dict]:
    """Every test row of an evaluation set by its hub name (needs ``datasets`` and a network)."""
    name = bundled_name(name)
    if name in WHOLLY_BUNDLED:
        return load_bundled(name)
    try:
        import datasets
    except ImportError:
        raise BlockspecError(f"loading {name} from the hub needs the 'datasets' package: pip install datasets, "
                             "or use the bundled subsets or --data-dir") from None
    repo, subset, split = HUB_DATASETS[name]
    try:
        table = datasets.load_dataset(repo, subset, split=split)
    except Exception as error:  # network, auth and format errors all end the same way
        raise BlockspecError(f"could not load {repo} from the hub ({error}); offline, use --data-dir") from None
    rows = (format_source_row(name, dict(raw), index) for index, raw in enumerate(table))
    return [row for row in rows if row is not None]


def _source_row(name: str, line: str, where: str, index: int) -> dict | None:
    try:
        return format_source_row(name, json.loads(line), index)
    except json.JSONDecodeError as error:
        raise BlockspecError(f"{where} is not valid JSON ({error.msg})") from None
    except (KeyError, TypeError, ValueError) as error:
        raise BlockspecError(f"{where} is not a {name} row (missing or bad field {error})") from None


def load_benchmark_prompts(name: str, *, source: str = "bundled", num_prompts: int | None = None,
                           seed: int | None = None) -> list[dict]:
    """Prompts of one set: ``name`` is a known set or a JSON-lines file; ``source`` is
    "bundled", "hub" or a data directory. ``num_prompts`` rows: the first ones, or a random
    choice when ``seed`` is given (kept in the set's order)."""
    if num_prompts is not None and num_prompts < 1:
        raise BlockspecError(f"--num-prompts must be >= 1, got {num_prompts}")
    if Path(name).suffix in (".jsonl", ".json") or Path(name).is_file():
        rows = load_prompt_file(name)
    elif source == "bundled":
        rows = load_bundled(name)
    elif source == "hub":
        rows = load_from_hub(name)
    else:
        rows = load_from_directory(name, source)
    return select_rows(rows, num_prompts, seed)


def select_rows(rows: list[dict], count: int | None, seed: int | None) -> list[dict]:
    if count is None or count >= len(rows):
        return list(rows)
    if seed is None:
        return rows[:count]
    chosen = sorted(random.Random(seed).sample(range(len(rows)), count))
    return [rows[i] for i in chosen]
