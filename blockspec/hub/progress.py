"""Progress output of a model install: messages and byte bars on stderr, or nothing."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any


def say(enabled: bool, message: str) -> None:
    if enabled:
        print(f"blockspec: {message}", file=sys.stderr)


class _NoBar:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def byte_bar(total: int, enabled: bool, label: str) -> Iterator[Any]:
    if not enabled:
        yield _NoBar()
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc=label, file=sys.stderr) as bar:
        yield bar


@contextlib.contextmanager
def library_progress_bars(enabled: bool) -> Iterator[None]:
    """Hide transformers' progress bars when asked: they write to whatever `sys.stderr` is."""
    if enabled:
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        yield
