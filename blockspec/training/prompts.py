"""Training prompts read from files: jsonl / json (either gzipped), in many row layouts.

`load_prompts` reads prompt files into `PromptRecord`s with ids that are stable across
runs (file stem + row index), skipping rows without text, duplicates, rows over a length
limit and the MBPP test split (task_id 11..510), and says per file what it read and
skipped (`LoadReport`).
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockspec.data.benchmarks import MBPP_TEST_IDS, REASONING_INSTRUCTION
from blockspec.errors import BlockspecError
from blockspec.training.function_stubs import STUB_WRAPPERS, function_stub

NO_TEXT = "no_text"
TEST_SPLIT = "test_split"
DUPLICATE = "duplicate"
TOO_LONG = "too_long"
SKIP_REASONS = (NO_TEXT, TEST_SPLIT, DUPLICATE, TOO_LONG)

GSM8K_INSTRUCTION = REASONING_INSTRUCTION  # the benchmark's gsm8k (and math500) phrasing

#: Ways users ask: a drafter trained on one phrasing of its prompts drafts worse for the others.
#: "suffix" is the benchmark's gsm8k phrasing; a "chat" record takes one of CHAT_WRAPPERS; "stub"
#: asks a coding task as a function stub to complete (`function_stub`, HumanEval's form) in one of
#: STUB_WRAPPERS, and applies only to records whose response is Python defining a function.
PROMPT_STYLES = ("plain", "suffix", "chat", "stub")
CHAT_WRAPPERS = (
    "Can you help me with this?\n\n{}",
    "{}\nShow your work.",
    "Solve this: {}",
    "Question: {}\nAnswer:",
    "Hi! {} Thanks in advance.",
    "I'm stuck on this one. {}",
    "{}\nExplain briefly.",
)

# Fields tried, in this order, for a row's prompt text and for a response given in the data.
PROMPT_FIELDS = ("prompt", "instruction", "question", "text")
RESPONSE_FIELDS = ("response", "output", "completion", "answer")


@dataclass
class PromptRecord:
    """One training prompt: chat messages, plus the response the data gives (if any)."""

    id: str
    messages: list[dict]
    response: str | None = None
    tests: tuple[str, ...] = ()  # the row's test asserts (MBPP test_list), for the "stub" style


@dataclass
class FileReport:
    path: str
    kind: str = ""  # the most common row layout: gsm8k, alpaca, mbpp, messages, turns, prompt...
    read: int = 0  # rows in the file
    kept: int = 0  # rows returned (after the limit)
    over_limit: int = 0  # usable rows left out by `limit`
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    warnings: list[str] = field(default_factory=list)


@dataclass
class LoadReport:
    files: list[FileReport] = field(default_factory=list)

    @property
    def read(self) -> int:
        return sum(f.read for f in self.files)

    @property
    def kept(self) -> int:
        return sum(f.kept for f in self.files)

    @property
    def over_limit(self) -> int:
        return sum(f.over_limit for f in self.files)

    @property
    def skipped(self) -> dict[str, int]:
        total: Counter = Counter()
        for f in self.files:
            total.update(f.skipped)
        return dict(total)

    def summary(self) -> str:
        lines = []
        for f in self.files:
            skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(f.skipped.items()) if n)
            line = f"{f.path} ({f.kind}): {f.read} rows, {f.kept} kept"
            if f.over_limit:
                line += f", {f.over_limit} over the limit"
            if skipped:
                line += f", skipped {skipped}"
            lines.append(line)
            lines.extend(f"  warning: {w}" for w in f.warnings)
        return "\n".join(lines)



def load_prompts(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    limit: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    max_chars: int | None = None,
    format_prompts: bool = True,
) -> tuple[list[PromptRecord], LoadReport]:
    """Read prompt files into records.

    Layouts (per row): `messages` (list of {role, content}; a final assistant message is
    the response), `conversations` ({from, value}), `turns` (user strings: the first turn
    is the prompt), or one of the text fields `prompt`, `instruction` (+ `input`, alpaca),
    `question` (gsm8k), `text` (mbpp). An optional `system` string becomes a system message.
    Files: .jsonl, .json (a list of objects), either one gzipped.

    Rows of an MBPP-like file (name contains "mbpp", or rows with `task_id` and
    `test_list`) with task_id 11..510 are the MBPP test split and are always excluded.
    With `format_prompts`, gsm8k questions get the benchmark's reasoning instruction, so
    the target answers training prompts the way it answers benchmark prompts.
    Rows whose prompt is longer than `max_chars` characters are skipped as too long.
    Records are shuffled with `seed` (after reading all files), then cut to `limit`.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise BlockspecError("no prompt files given: pass at least one .jsonl or .json file")

    report = LoadReport()
    records: list[PromptRecord] = []
    file_of: dict[str, FileReport] = {}
    seen: set = set()  # the messages of the records kept so far
    for path, prefix in zip(paths, _id_prefixes(paths)):
        file_records, file_report = _read_prompt_file(path, prefix, seen, max_chars=max_chars,
                                                      format_prompts=format_prompts)
        report.files.append(file_report)
        records += file_records
        file_of.update((record.id, file_report) for record in file_records)
    if not records:
        raise BlockspecError(
            f"no usable prompts in {', '.join(str(p) for p in paths)}:\n{report.summary()}\n"
            "Each row needs a non-empty `prompt`, `instruction`, `question`, `text`, "
            "`messages` or `turns` field.")
    if shuffle:
        random.Random(seed).shuffle(records)
    if limit is not None:
        if limit < 1:
            raise BlockspecError(f"limit must be a positive number of prompts, got {limit}")
        for record in records[limit:]:
            file_of[record.id].over_limit += 1
        records = records[:limit]
    for record in records:
        file_of[record.id].kept += 1
    return records, report


def restyle_prompts(records: Sequence[PromptRecord], styles: Sequence[str], *, seed: int = 0) -> list[PromptRecord]:
    """Each record's last user message asked in one of ``styles`` (PROMPT_STYLES), picked per record
    from ``seed`` and its id among the styles that apply to it; the id gains ``@style`` so restyled
    prompts never clash with the originals. A record no style applies to ("stub" alone, for a record
    without a function to stub) is left out."""
    unknown = sorted(set(styles) - set(PROMPT_STYLES))
    if unknown or not styles:
        raise BlockspecError(f"prompt styles must be some of {', '.join(PROMPT_STYLES)}, got {list(styles)}")
    restyled = []
    for record in records:
        pick = random.Random(f"{seed}:{record.id}")
        messages = [dict(m) for m in record.messages]
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        text = messages[last]["content"]
        stub = function_stub(text, record.response, record.tests) if "stub" in styles and record.response else None
        usable = [style for style in styles if style != "stub" or stub is not None]
        if not usable:
            continue
        style = pick.choice(usable)
        if style == "suffix":
            text = text + GSM8K_INSTRUCTION
        elif style == "chat":
            text = pick.choice(CHAT_WRAPPERS).format(text)
        elif style == "stub":
            text = pick.choice(STUB_WRAPPERS).format(prompt=stub)
        messages[last]["content"] = text
        restyled.append(PromptRecord(id=f"{record.id}@{style}", messages=messages, response=record.response,
                                     tests=record.tests))
    return restyled


def record_id(row_id: str) -> str:
    """The record a row id names: a restyled prompt's (``ID@style``, from ``restyle_prompts``) is ID."""
    base, at, style = row_id.rpartition("@")
    return base if at and style in PROMPT_STYLES else row_id


def _id_prefixes(paths: list[Path]) -> list[str]:
    """The record id prefix of each file: its stem, made unique with the file's index."""
    prefixes: list[str] = []
    for index, path in enumerate(paths):
        prefix = _file_stem(path)
        prefixes.append(f"{prefix}~{index}" if prefix in prefixes else prefix)
    return prefixes


def _read_prompt_file(path: Path, prefix: str, seen: set, *, max_chars: int | None,
                      format_prompts: bool) -> tuple[list[PromptRecord], FileReport]:
    """The usable rows of one file as records (prompts not `seen` before), and its report."""
    report = FileReport(path=str(path), skipped={reason: 0 for reason in SKIP_REASONS})
    is_mbpp_file = "mbpp" in path.name.lower()
    is_gsm8k_file = "gsm8k" in path.name.lower()
    kinds: Counter = Counter()
    mbpp_without_task_id = 0
    records = []
    for row_index, (_line, row) in enumerate(_read_rows(path)):
        report.read += 1
        parsed = _parse_row(row, is_mbpp_file=is_mbpp_file, is_gsm8k_file=is_gsm8k_file,
                            format_prompts=format_prompts)
        if isinstance(parsed, str):
            report.skipped[parsed] += 1
            continue
        kinds[parsed.kind] += 1
        mbpp_without_task_id += parsed.missing_task_id
        if max_chars is not None and sum(len(m["content"]) for m in parsed.messages) > max_chars:
            report.skipped[TOO_LONG] += 1
            continue
        key = tuple((m["role"], m["content"].strip()) for m in parsed.messages)
        if key in seen:
            report.skipped[DUPLICATE] += 1
            continue
        seen.add(key)
        records.append(PromptRecord(id=f"{prefix}:{row_index}", messages=parsed.messages, response=parsed.response,
                                    tests=parsed.tests))
    report.kind = "+".join(k for k, _ in kinds.most_common(2)) or "none"
    if mbpp_without_task_id:
        report.warnings.append(
            f"{mbpp_without_task_id} rows of this MBPP-like file have no integer task_id, so the "
            "test split (task_id 11..510) could not be excluded for them")
    if _looks_like_eval_set(path):
        report.warnings.append("the file name looks like an evaluation set; never train on a test split")
    return records, report


def _file_stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    return name or path.name


def _looks_like_eval_set(path: Path) -> bool:
    name = path.name.lower()
    return any(word in name for word in ("test", "humaneval", "math500", "mt_bench", "mt-bench"))


def _read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed row) for each row of a .jsonl or .json file (optionally .gz)."""
    if not path.exists():
        raise BlockspecError(f"prompt file not found: {path} (check the path)")
    if path.is_dir():
        raise BlockspecError(f"{path} is a directory: pass the .jsonl/.json files themselves")
    try:
        raw = path.read_bytes()
        if path.name.lower().endswith(".gz"):
            raw = gzip.decompress(raw)
        text = raw.decode("utf-8-sig")
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise BlockspecError(f"cannot read {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise BlockspecError(f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    if not text.strip():
        raise BlockspecError(f"{path} is empty: it needs one JSON object per line (.jsonl) "
                             "or a JSON list of objects (.json)")

    stem_suffix = path.name.lower().removesuffix(".gz")
    if stem_suffix.endswith(".json") or text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            # A .json file may hold JSON lines; anything else is a real error.
            if not (e.msg == "Extra data" and text.lstrip().startswith("{")):
                raise BlockspecError(
                    f"{path}: line {e.lineno}, column {e.colno}: malformed JSON ({e.msg}); fix the "
                    "file there (a .json file must be one JSON list of objects)") from None
        else:
            rows = _rows_of_json(data, path)
            if not rows:
                raise BlockspecError(f"{path} holds no rows (an empty list); add prompts to it")
            for i, row in enumerate(rows):
                yield i + 1, row
            return

    count = 0
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BlockspecError(
                f"{path}: line {line_number}, column {e.colno}: malformed JSON ({e.msg}); fix or "
                "delete that line (each line of a .jsonl file must be one JSON object)") from None
        count += 1
        yield line_number, row
    if count == 0:  # pragma: no cover - text.strip() was non-empty, so some line parsed
        raise BlockspecError(f"{path} holds no rows")


def _rows_of_json(data: Any, path: Path) -> list:
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        for key in ("data", "rows", "examples", "train", "instances"):
            if isinstance(data.get(key), list):
                return data[key]
        return [data]
    raise BlockspecError(f"{path}: expected a JSON list of objects, found {type(data).__name__}")


def _text(value: Any) -> str | None:
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list):  # content given as parts: [{"type": "text", "text": ...}]
        parts = [p.get("text") for p in value if isinstance(p, dict) and isinstance(p.get("text"), str)]
        joined = "".join(parts)
        return joined if joined.strip() else None
    return None


_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant",
                 "user": "user", "assistant": "assistant", "system": "system"}


def _normalize_messages(value: Any) -> list[dict] | None:
    if not isinstance(value, list):
        return None
    messages = []
    for m in value:
        if not isinstance(m, dict):
            return None
        role = m.get("role", m.get("from"))
        content = _text(m.get("content", m.get("value")))
        role = _ROLE_ALIASES.get(str(role).lower()) if role is not None else None
        if role is None or content is None:
            continue
        messages.append({"role": role, "content": content})
    return messages



@dataclass
class _ParsedRow:
    messages: list[dict]
    response: str | None
    kind: str  # the row's layout
    missing_task_id: int  # 1 for a row of an MBPP-like file without an integer task_id
    tests: tuple[str, ...] = ()


def _parse_row(row: Any, *, is_mbpp_file: bool, is_gsm8k_file: bool, format_prompts: bool) -> _ParsedRow | str:
    """The row's messages and response, or the reason to skip it."""
    if not isinstance(row, dict):
        return NO_TEXT
    is_mbpp = is_mbpp_file or ("test_list" in row and "task_id" in row)
    task_id = _mbpp_task_id(row) if is_mbpp else None
    if task_id is not None and task_id in MBPP_TEST_IDS:
        return TEST_SPLIT
    conversation = row.get("messages", row.get("conversations"))
    if conversation is None and isinstance(row.get("prompt"), list):
        conversation = row["prompt"]
    if conversation is not None:
        parsed = _conversation(conversation)
    elif "turns" in row:
        parsed = _first_turn(row["turns"])
    else:
        parsed = _text_fields(row, is_mbpp=is_mbpp, is_gsm8k_file=is_gsm8k_file, format_prompts=format_prompts)
    if isinstance(parsed, str):
        return parsed
    parsed.missing_task_id = int(is_mbpp and task_id is None)
    if is_mbpp and isinstance(row.get("test_list"), list):
        parsed.tests = tuple(t for t in row["test_list"] if isinstance(t, str))
    if parsed.response is None:
        fields = RESPONSE_FIELDS + (("code",) if is_mbpp else ())
        parsed.response = next((r for r in (_text(row.get(f)) for f in fields) if r is not None), None)
    system = _text(row.get("system"))
    if system is not None and not any(m["role"] == "system" for m in parsed.messages):
        parsed.messages.insert(0, {"role": "system", "content": system})
    return parsed


def _mbpp_task_id(row: dict) -> int | None:
    task_id = row.get("task_id")
    if isinstance(task_id, str) and task_id.strip().isdigit():
        task_id = int(task_id)
    return task_id if isinstance(task_id, int) and not isinstance(task_id, bool) else None


def _conversation(conversation: Any) -> _ParsedRow | str:
    """A chat: a final assistant message is the response; a user message is required."""
    messages = _normalize_messages(conversation) or []
    response = messages.pop()["content"] if messages and messages[-1]["role"] == "assistant" else None
    if not any(m["role"] == "user" for m in messages):
        return NO_TEXT
    return _ParsedRow(messages, response, "messages", 0)


def _first_turn(turns: Any) -> _ParsedRow | str:
    """MT-Bench-like rows: the first turn with text is the prompt."""
    turns = turns if isinstance(turns, list) else [turns]
    first = next((t for t in (_text(t) for t in turns) if t is not None), None)
    if first is None:
        return NO_TEXT
    return _ParsedRow([{"role": "user", "content": first}], None, "turns", 0)


def _text_fields(row: dict, *, is_mbpp: bool, is_gsm8k_file: bool, format_prompts: bool) -> _ParsedRow | str:
    """The first of PROMPT_FIELDS with text, shaped by the row's layout (alpaca, gsm8k, mbpp)."""
    kind, prompt = next(((name, text) for name in PROMPT_FIELDS if (text := _text(row.get(name))) is not None),
                        ("prompt", None))
    if prompt is None:
        return NO_TEXT
    if kind == "instruction":
        kind = "alpaca" if "output" in row else "instruction"
        extra = _text(row.get("input"))
        if extra is not None:
            prompt = f"{prompt}\n\n{extra}"
    elif kind == "question" and (is_gsm8k_file or "####" in str(row.get("answer", ""))):
        kind = "gsm8k"
        if format_prompts:
            prompt = prompt + GSM8K_INSTRUCTION
    elif is_mbpp:
        kind = "mbpp"
    return _ParsedRow([{"role": "user", "content": prompt}], None, kind, 0)
