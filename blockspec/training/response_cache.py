"""The response cache: target responses on disk, one JSON object a line.

    {"id", "prompt_ids", "response_ids", "finished", "batch", "batch_rows"}

`finished` is True when the response ended on a stop token (kept as its last id) and False
when it was cut at max_new_tokens. `batch`/`batch_rows` let a resumed run recognise a batch
that a kill cut short; such a batch is dropped on opening and generated again as a whole. A
sidecar `<cache>.meta.json` records the model and the generation settings; a cache is only
resumed with the same settings.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from blockspec.errors import BlockspecError
from blockspec.io import write_text_atomically

CACHE_FORMAT = "blockspec-responses"
CACHE_VERSION = 1


def meta_path(cache_path: str | os.PathLike) -> Path:
    cache_path = Path(cache_path)
    return cache_path.with_name(cache_path.name + ".meta.json")


def read_cache(cache_path: str | os.PathLike) -> list[dict]:
    """The rows of a response cache, in file order (a truncated last line is ignored;
    a repeated id keeps its first row)."""
    cache_path = Path(cache_path)
    if not cache_path.exists():
        raise BlockspecError(f"response cache not found: {cache_path}; generate it first "
                             "(generate_responses or responses_from_data)")
    rows, seen = [], set()
    for row in _scan_cache(cache_path, drop_incomplete_batches=False).rows:
        if row["id"] not in seen:
            seen.add(row["id"])
            rows.append(row)
    return rows


def append_rows(cache: IO[str], rows: list[dict]) -> None:
    """Append rows to an open cache and make them durable before going on."""
    cache.write("".join(_row_line(row) for row in rows))
    cache.flush()
    os.fsync(cache.fileno())


@dataclass
class _CacheScan:
    rows: list[dict]  # complete rows, in file order
    clean: bool  # the file is exactly these rows, one a line, newline-terminated


def _scan_cache(cache_path: Path, *, drop_incomplete_batches: bool) -> _CacheScan:
    """Read a cache, ignoring a truncated last line (a kill mid-write)."""
    if not cache_path.exists():
        return _CacheScan(rows=[], clean=True)
    data = cache_path.read_bytes()
    lines = data.split(b"\n")
    clean = data.endswith(b"\n") or not data
    rows = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            if i < len(lines) - 1:
                clean = False
            continue
        try:
            row = json.loads(line)
            ok = (isinstance(row, dict) and isinstance(row.get("id"), str)
                  and isinstance(row.get("prompt_ids"), list)
                  and isinstance(row.get("response_ids"), list))
        except (json.JSONDecodeError, UnicodeDecodeError):
            ok = False
        if not ok:
            if i == last:  # a truncated last line: the row is generated again
                clean = False
                continue
            raise BlockspecError(
                f"{cache_path}: line {i + 1} is not a valid cache row; the cache is corrupt. "
                "Delete the file (or pass overwrite=True) to generate it again")
        rows.append(row)

    if drop_incomplete_batches:
        seen = Counter(r["batch"] for r in rows if "batch" in r)
        incomplete = {r["batch"] for r in rows
                      if "batch" in r and seen[r["batch"]] < int(r.get("batch_rows", 1))}
        if incomplete:
            rows = [r for r in rows if r.get("batch") not in incomplete]
            clean = False
    return _CacheScan(rows=rows, clean=clean)


def _row_line(row: dict) -> str:
    return json.dumps(row, separators=(",", ":")) + "\n"


def _rewrite_cache(cache_path: Path, rows: list[dict]) -> None:
    write_text_atomically(cache_path, "".join(_row_line(row) for row in rows))


def open_cache(cache_path: Path, settings: dict, info: dict, *, overwrite: bool) -> dict[str, dict]:
    """Check the sidecar, prepare the cache for appending; return the done rows by id."""
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    meta_file = meta_path(cache_path)
    if overwrite:
        for p in (cache_path, meta_file):
            p.unlink(missing_ok=True)
    has_rows = cache_path.exists() and cache_path.stat().st_size > 0
    if has_rows:
        _check_settings(cache_path, meta_file, settings)
    scan = _scan_cache(cache_path, drop_incomplete_batches=True)
    if not scan.clean:
        _rewrite_cache(cache_path, scan.rows)
    if not has_rows or not meta_file.exists():
        meta = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "settings": settings, "info": info}
        write_text_atomically(meta_file, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    done: dict[str, dict] = {}
    for row in scan.rows:
        done.setdefault(row["id"], row)
    return done


def _check_settings(cache_path: Path, meta_file: Path, settings: dict) -> None:
    """Refuse to resume a cache made with other settings (or whose sidecar is gone)."""
    if not meta_file.exists():
        raise BlockspecError(
            f"{cache_path} exists but its settings file {meta_file.name} is missing, so it cannot "
            "be resumed safely; delete the cache, choose another path, or pass overwrite=True")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise BlockspecError(f"{meta_file} does not parse ({e}); delete it and the cache, "
                             "or pass overwrite=True") from None
    if meta.get("format") != CACHE_FORMAT or meta.get("version") != CACHE_VERSION:
        raise BlockspecError(f"{meta_file} is not a version-{CACHE_VERSION} blockspec response "
                             "cache; use another path or pass overwrite=True")
    old = meta.get("settings", {})
    if old != settings:
        diffs = [f"{k}: cache {old.get(k)!r}, now {settings.get(k)!r}"
                 for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
        raise BlockspecError(
            f"{cache_path} was made with other settings ({'; '.join(diffs)}); resuming would mix "
            "them. Use the same settings, another cache path, or overwrite=True to start over")
