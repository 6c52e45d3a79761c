"""The trainer core: what training a drafter and adapting a dLLM share.

AdamW with linear warmup and a cosine decay, gradient clipping, the samples' order (epoch
after epoch, each shuffled from the seed and the epoch), the step loop with its progress bar,
Ctrl-C (held back while a step updates the weights, then a checkpoint), checkpoints every
``save_every`` steps and at the end, and exact resume. A trainer subclasses ``TrainingLoop``
and gives one step (``_train_step``) and its model's files (``_write_model``).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from blockspec.errors import BlockspecError, CheckpointError
from blockspec.io import save_atomically
from blockspec.training.checkpoints import (
    KEEP_CHECKPOINTS,
    checkpoint_dir,
    first_line_of,
    latest_name,
    load_training_state,
    prune_checkpoints,
    remove_staging,
    restore_training_state,
    save_training_state,
    saved_checkpoints,
    write_checkpoint,
)
from blockspec.training.distributed import barrier


@dataclass
class TrainState:
    step: int = 0
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0  # in training steps, over all runs of this output directory

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / len(self.losses) if self.losses else math.nan


@dataclass
class StepResult:
    """What one step shows on the progress bar."""

    loss: float
    accuracy: float | None = None
    tokens: int = 0


#: Training seeds: the trainers derive a generator seed per step from them, within 64 bits.
MAX_TRAINING_SEED = 2**31 - 1


def check_positive(**values) -> None:
    """Refuse settings that must be finite and > 0 (None: not set)."""
    for name, value in values.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise BlockspecError(f"{name} must be a number > 0, got {value}")


def check_at_least(minimum: float, **values) -> None:
    """Refuse settings that must be finite and >= ``minimum``."""
    for name, value in values.items():
        if not (math.isfinite(value) and value >= minimum):
            raise BlockspecError(f"{name} must be a number >= {minimum}, got {value}")


def check_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_TRAINING_SEED:
        raise BlockspecError(f"seed must lie in [0, {MAX_TRAINING_SEED}], got {seed}")


def cosine_with_warmup(total_steps: int, warmup_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


class SampleOrder:
    """Which samples a run takes, one after another: epoch after epoch, each epoch in an order
    drawn once from a generator seeded by the seed and the epoch."""

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed
        self._epoch, self._order = None, []

    def take(self, start: int, size: int) -> list[int]:
        """The sample indices at positions ``start`` .. ``start + size - 1`` of the run."""
        return [self._epoch_order(flat // self.count)[flat % self.count] for flat in range(start, start + size)]

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._epoch != epoch:
            generator = torch.Generator().manual_seed(self.seed + 7919 * epoch)
            self._order = torch.randperm(self.count, generator=generator).tolist()
            self._epoch = epoch
        return self._order


class InterruptGuard:
    """Holds Ctrl-C back while a step updates weights, optimizer and step count, so that the
    checkpoint written on Ctrl-C always holds whole steps. Elsewhere Ctrl-C acts at once.
    Outside the main thread (no signal handlers there) it holds nothing back."""

    def __init__(self):
        self.holding = False
        self.pending = False
        self._installed = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGINT, self._on_interrupt)
            self._installed = True
        except ValueError:
            self._installed = False
        return self

    def __exit__(self, *exc):
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _on_interrupt(self, signum, frame):
        if not self.holding:
            raise KeyboardInterrupt
        self.pending = True

    @contextmanager
    def hold(self):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


class TrainingLoop:
    """The loop, optimizer, checkpoints and resume of a trainer.

    A subclass builds its model, then calls ``TrainingLoop.__init__``; it gives
    ``_train_step(step)`` (gradients, then ``_update``), ``_write_model(directory)`` (the
    model's files, in a checkpoint and at the end), and may give ``_after_step(bar)`` (e.g.
    an evaluation), ``_check_resumable`` and ``_saved_weights``.
    """

    progress_label = "training"
    final_dir_name = "model"

    def __init__(self, *, out, model, config, state: TrainState, total_steps: int, lr: float, weight_decay: float,
                 warmup_ratio: float, grad_clip: float, save_every: int, keep_checkpoints: int = KEEP_CHECKPOINTS,
                 progress: bool = True, rank: int = 0):
        self.out, self.model, self.config, self.state = Path(out), model, config, state
        self.total_steps, self.grad_clip, self.rank = total_steps, grad_clip, rank
        self.save_every, self.keep_checkpoints, self.progress = save_every, keep_checkpoints, progress
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           cosine_with_warmup(total_steps, warmup_ratio))
        self.guard = InterruptGuard()
        self._saved_step: int | None = None
        self._step_started = time.perf_counter()
        if rank == 0:
            remove_staging(self.out, self.final_dir_name)

    # --- the loop -------------------------------------------------------------------

    def run(self, until_step: int | None = None) -> TrainState:
        """Train to the end (or to ``until_step``); Ctrl-C saves a checkpoint and re-raises."""
        last = min(self.total_steps, until_step or self.total_steps)
        bar = tqdm(total=self.total_steps, initial=self.state.step, desc=self.progress_label, unit="step",
                   disable=not self.progress or self.rank != 0, dynamic_ncols=True)
        started, tokens = time.perf_counter(), 0
        try:
            with self.guard:
                while self.state.step < last:
                    self._step_started = time.perf_counter()
                    result = self._train_step(self.state.step)
                    tokens += result.tokens
                    bar.update(1)
                    bar.set_postfix(self._postfix(result, tokens / (time.perf_counter() - started)))
                    self._after_step(bar)
                    if self.save_every and self.state.step % self.save_every == 0:
                        self.save_checkpoint()
        except KeyboardInterrupt:
            bar.write(f"interrupted after step {self.state.step}: saving a checkpoint")
            self.save_checkpoint()
            raise
        finally:
            bar.close()
        self.save_checkpoint()
        if self.state.step >= self.total_steps:
            self.save_final()
        return self.state

    def _train_step(self, step: int) -> StepResult:
        raise NotImplementedError

    def _update(self, loss: float) -> None:
        """Clip, step the optimizer and the schedule, count the step: all or nothing under Ctrl-C."""
        with self.guard.hold():
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.state.step += 1
            self.state.losses.append(loss)
            self.state.seconds += time.perf_counter() - self._step_started

    def _postfix(self, result: StepResult, tokens_per_second: float) -> dict[str, str]:
        postfix = {"loss": f"{result.loss:.3f}"}
        if result.accuracy is not None:
            postfix["acc"] = f"{result.accuracy:.2f}"
        postfix["lr"] = f"{self.scheduler.get_last_lr()[0]:.1e}"
        if result.tokens:
            postfix["tok_s"] = f"{tokens_per_second:.0f}"
        return postfix

    def _after_step(self, bar) -> None:
        pass

    # --- checkpoints ----------------------------------------------------------------

    def _write_model(self, directory: Path) -> None:
        raise NotImplementedError

    def save_checkpoint(self) -> Path | None:
        """The model and what resuming needs, written atomically (on rank 0), then ``latest``; a step
        already saved is not written again (rewriting it would briefly leave no checkpoint)."""
        directory = None
        if self.rank == 0:
            directory = checkpoint_dir(self.out, self.state.step)
            if self._saved_step != self.state.step:
                directory = write_checkpoint(self.out, self.state.step, self._write_checkpoint)
                self._saved_step = self.state.step
                prune_checkpoints(self.out, self.keep_checkpoints, directory)
        barrier()
        return directory

    def _write_checkpoint(self, directory: Path) -> None:
        self._write_model(directory)
        save_training_state(directory, optimizer=self.optimizer, scheduler=self.scheduler, state=self.state,
                            config=self.config)

    def save_final(self) -> Path | None:
        """The trained model in ``OUT/<final_dir_name>``, and the settings in ``OUT/train_config.json``."""
        directory = None
        if self.rank == 0:
            directory = save_atomically(self._write_model, self.out / self.final_dir_name)
            (self.out / "train_config.json").write_text(json.dumps(asdict(self.config), indent=1))
        barrier()
        return directory

    # --- resume ---------------------------------------------------------------------

    def _resume_latest(self) -> bool:
        """Continue from the newest checkpoint of ``out`` that loads; whether there was one. Saying which,
        when it is not the one ``latest`` names; refusing, with the reasons, when none loads."""
        found = saved_checkpoints(self.out)
        if not found:
            self._say(f"--resume: no checkpoint in {self.out / 'checkpoints'} yet: starting at step 0")
            return False
        problems = []
        for directory in found:
            try:
                saved, weights = self._read_checkpoint(directory)
            except CheckpointError as error:
                problems.append(f"{directory.name}: {error}")
                continue
            self._check_resumable(saved["config"], directory)
            self.model.load_state_dict(weights)
            restore_training_state(saved, optimizer=self.optimizer, scheduler=self.scheduler)
            self.state = type(self.state)(**saved["state"])
            self._saved_step = self.state.step
            if problems or latest_name(self.out) != directory.name:
                self._say(f"resuming from {directory.name}, the newest complete checkpoint ({self._skipped(problems)})")
            return True
        raise BlockspecError(f"--resume: no checkpoint in {self.out / 'checkpoints'} loads ({'; '.join(problems)}): "
                             "remove the broken ones, or start the run again in another --out")

    def _read_checkpoint(self, directory: Path) -> tuple[dict, dict]:
        """The saved training state and model weights of a checkpoint; a CheckpointError if either does not load."""
        saved = load_training_state(directory)
        try:
            return saved, self._saved_weights(directory)
        except Exception as error:  # noqa: BLE001 - a damaged checkpoint fails to load in many ways
            raise CheckpointError(f"its model does not load ({first_line_of(error)})") from None

    def _skipped(self, problems: list[str]) -> str:
        latest = latest_name(self.out)
        if latest is None:
            said = "there is no 'latest' file"
        elif latest not in {p.name for p in saved_checkpoints(self.out)}:
            said = f"'latest' names {latest!r}, which is not there"
        else:
            said = f"'latest' names {latest!r}"
        return "; ".join([said, *problems])

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"blockspec: {message}", file=sys.stderr, flush=True)

    def _check_resumable(self, saved_config: dict, directory: Path) -> None:
        pass

    def _saved_weights(self, directory: Path) -> dict:
        raise NotImplementedError
