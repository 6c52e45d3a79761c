"""Prompt sets: the small subsets bundled in the package, and any JSON-lines prompt file.

Every loader returns rows ``{"id", "dataset", "turns": [user messages], ...}``; extra
fields of the source (``answer``, ``category``) are kept.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from blockspec.errors import BlockspecError

#: Names of the bundled subsets (files ``blockspec/data/prompts/<name>.jsonl``).
BUNDLED = ("gsm8k", "humaneval", "math500", "mbpp", "mt_bench")

_PROMPT_PACKAGE = "blockspec.data.prompts"
_TEXT_FIELDS = ("prompt", "question", "text")


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
            raise BlockspecError(f"{label} line {number} is not valid JSON ({error.msg}): one JSON object per line") from None
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
