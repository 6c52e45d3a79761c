"""Checkpoints of a training run on disk, and the state that lets a resumed run continue exactly.

    OUT/checkpoints/step-0000200/       the model's files, trainer_state.pt, trainer_state.json
    OUT/checkpoints/latest              the name of the newest complete checkpoint

A checkpoint is written into a staging directory and moved into place whole; only then does
``latest`` point at it, so a kill while a step is written leaves ``latest`` on the last
complete checkpoint (and a staging directory, removed when the next run starts). Only the
newest ``keep`` checkpoints stay on disk. A resumed run takes the newest checkpoint that
loads, whatever ``latest`` says (a file lost or cut short by hand, a full disk).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from blockspec.errors import CheckpointError
from blockspec.io import save_atomically, write_text_atomically

STATE_FILE = "trainer_state.pt"
STATE_SUMMARY_FILE = "trainer_state.json"
LATEST_FILE = "latest"
#: Checkpoints a run keeps on disk unless told otherwise: the newest few.
KEEP_CHECKPOINTS = 3
#: What a saved training state holds (see ``save_training_state``).
STATE_KEYS = ("optimizer", "scheduler", "state", "config")


def checkpoint_dir(out: str | Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step-{step:07d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint directory named step-N (None for any other name)."""
    prefix, _, number = path.name.partition("-")
    return int(number) if prefix == "step" and number.isdigit() else None


def saved_checkpoints(out: str | Path) -> list[Path]:
    """The checkpoint directories of ``out``, newest step first."""
    folder = Path(out) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step, reverse=True)


def latest_name(out: str | Path) -> str | None:
    """What ``latest`` says (None without one)."""
    pointer = Path(out) / "checkpoints" / LATEST_FILE
    try:
        return pointer.read_bytes().decode("utf-8", "replace").strip()
    except OSError:
        return None


def remove_staging(out: str | Path, final_dir_name: str) -> None:
    """Remove what writes killed part-way left behind: staging checkpoints and ``latest`` files, and
    staging or retired copies of the final model."""
    out = Path(out)
    leftovers = list((out / "checkpoints").glob(".step-*")) + list((out / "checkpoints").glob(f".{LATEST_FILE}.*"))
    leftovers += list(out.glob(f".{final_dir_name}.*"))
    for path in leftovers:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def write_checkpoint(out: str | Path, step: int, write) -> Path:
    """``write(tmp_dir)`` fills the checkpoint of ``step``; it is moved into place whole, then
    ``latest`` points at it."""
    directory = save_atomically(write, checkpoint_dir(out, step))
    write_text_atomically(Path(out) / "checkpoints" / LATEST_FILE, directory.name)
    return directory


def latest_checkpoint(out: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, if it is there."""
    name = latest_name(out)
    if not name or checkpoint_step(Path(name)) is None:
        return None
    directory = Path(out) / "checkpoints" / name
    return directory if directory.is_dir() else None


def prune_checkpoints(out: str | Path, keep: int, newest: Path) -> None:
    """Drop all but the ``keep`` newest checkpoints up to ``newest`` (0 keeps all), and what killed writes
    left behind. Checkpoints of later steps (a run resumed from before them) are left to be overwritten."""
    folder = Path(out) / "checkpoints"
    stale = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(".step-")]
    if keep:
        older = [p for p in saved_checkpoints(out) if checkpoint_step(p) < checkpoint_step(newest)]
        stale += older[keep - 1:]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


def save_training_state(directory: Path, *, optimizer, scheduler, state, config) -> None:
    """What resuming needs besides the model: optimizer, schedule, run state, settings, RNG."""
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "state": asdict(state), "config": asdict(config), "rng": _rng_state()}, directory / STATE_FILE)
    (directory / STATE_SUMMARY_FILE).write_text(json.dumps(asdict(state), indent=1))


def load_training_state(directory: Path) -> dict:
    """The saved training state of a checkpoint (see ``save_training_state``); a CheckpointError when it is
    missing, cut short or not a training state."""
    path = directory / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{STATE_FILE} is missing")
    try:
        saved = torch.load(path, weights_only=False)
    except Exception as error:  # noqa: BLE001 - torch.load fails in many ways on a damaged file
        raise CheckpointError(f"{STATE_FILE} does not load ({first_line_of(error)})") from None
    if not isinstance(saved, dict) or any(key not in saved for key in STATE_KEYS):
        raise CheckpointError(f"{STATE_FILE} is not a training state")
    return saved


def first_line_of(error: Exception) -> str:
    """An error in one short line: its type and the start of its message."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    first_sentence = lines[0].split(". ")[0]
    return f"{type(error).__name__}: {first_sentence[:160]}"


def restore_training_state(saved: dict, *, optimizer, scheduler) -> None:
    """Put the optimizer, the schedule and the random number generators back as they were saved."""
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    if "rng" in saved:  # older drafter checkpoints have none
        _set_rng_state(saved["rng"])


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
