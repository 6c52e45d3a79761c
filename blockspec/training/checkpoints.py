"""Checkpoints of a training run on disk, and the state that lets a resumed run continue exactly.

    OUT/checkpoints/step-0000200/       the model's files, trainer_state.pt, trainer_state.json
    OUT/checkpoints/latest              the name of the newest complete checkpoint

A checkpoint is written into a staging directory and moved into place whole; only then does
``latest`` point at it, so a kill while a step is written leaves ``latest`` on the last
complete checkpoint.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from blockspec.io import save_atomically, write_text_atomically

STATE_FILE = "trainer_state.pt"
STATE_SUMMARY_FILE = "trainer_state.json"
LATEST_FILE = "latest"


def checkpoint_dir(out: str | Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step-{step:07d}"


def write_checkpoint(out: str | Path, step: int, write) -> Path:
    """``write(tmp_dir)`` fills the checkpoint of ``step``; it is moved into place whole, then
    ``latest`` points at it."""
    directory = save_atomically(write, checkpoint_dir(out, step))
    write_text_atomically(Path(out) / "checkpoints" / LATEST_FILE, directory.name)
    return directory


def latest_checkpoint(out: str | Path) -> Path | None:
    pointer = Path(out) / "checkpoints" / LATEST_FILE
    if not pointer.is_file():
        return None
    directory = pointer.parent / pointer.read_text().strip()
    return directory if directory.is_dir() else None


def prune_checkpoints(out: str | Path, keep: int, newest: Path) -> None:
    """Drop all but the ``keep`` newest checkpoints (0 keeps all), and what killed writes left behind."""
    folder = Path(out) / "checkpoints"
    stale = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(".step-")]
    if keep:
        steps = sorted(p for p in folder.glob("step-*") if p.is_dir() and p != newest)
        stale += steps[: max(0, len(steps) - keep + 1)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


def save_training_state(directory: Path, *, optimizer, scheduler, state, config) -> None:
    """What resuming needs besides the model: optimizer, schedule, run state, settings, RNG."""
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "state": asdict(state), "config": asdict(config), "rng": _rng_state()}, directory / STATE_FILE)
    (directory / STATE_SUMMARY_FILE).write_text(json.dumps(asdict(state), indent=1))


def load_training_state(directory: Path) -> dict:
    """The saved training state of a checkpoint (see ``save_training_state``)."""
    return torch.load(directory / STATE_FILE, weights_only=False)


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
