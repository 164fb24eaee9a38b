"""Run several ``Trainer.fit`` side by side in one process, one step at a time: A/B/A/B timing through the public API.

Each configuration is a :class:`Runner`: its own copy of the model, its own ``lightning.Trainer`` with an
``ActivationCheckpointing`` callback configured as a user would (``policy="budget:…"`` or a fixed policy), fitted in
a thread of its own. A runner only runs when the main thread hands it steps (:meth:`Runner.run`), and hands control
back at the end of its last step, so exactly one fit computes at any moment and the steps of different
configurations interleave in whatever order the benchmark chooses (rotating rounds). Each step is timed from the
first callback's ``on_train_batch_start`` to the last callback's ``on_train_batch_end``: the forward, the backward,
the optimizer step and every hook of the plugin (its planning before the forward, its measurement after the step);
loading the next batch and the hand-over between threads are outside.

The plugin is read only where a user reads it: ``callback.last_metrics`` (the measured step's figures, among them
``memory/activations_gib``), ``callback.shape_plans``, ``callback.plan`` and the end-of-fit report's JSON
(``lightning_ckpt_report.json``, key ``budget``: the worst step against the budget with the calibration included,
the calibration's length in steps and the pricing time). Whether the calibration is over is read from
``callback.calibration.done``; if that attribute ever goes, from the plan no longer changing for three steps.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import random
import statistics
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from lightning_ckpt.core.units import GiB

REPORT_FILE = "lightning_ckpt_report.json"  # written beside the logs by the callback at the end of fit
ACTIVATIONS = "memory/activations_gib"


class _Batches(torch.utils.data.Dataset):
    """Batches handed out in order, already collated (``batch_size=None``); ``source(i)`` gives the i-th."""

    def __init__(self, source: Callable[[int], Any], length: int) -> None:
        self.source, self.length = source, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.source(i)


def quiet() -> None:
    """Lightning's per-Trainer notices (devices, tips, workers) off, and the plugin's notices at INFO with them (its
    plan lines, once per runner); the plugin's warnings stay, but the one asking for a logger (none is wanted here)."""
    import logging

    import lightning  # noqa: F401 - it sets its loggers' levels when imported: set ours after

    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for text in (".*does not have many workers.*", ".*the Trainer has no logger.*", ".*isinstance\\(treespec.*",
                 ".*smaller than the logging interval.*", ".*litlogger.*", ".*no `val_dataloader`.*"):
        warnings.filterwarnings("ignore", message=text)


class Runner:
    """One configuration: a model copy fitted by its own Trainer in its own thread, stepped from the main thread.

    Args:
        name: the label in tables.
        module: the ``LightningModule`` (copied: every runner starts from the same weights).
        batch: ``batch(i) -> batch`` for the i-th step.
        callback_kwargs: ``ActivationCheckpointing(**callback_kwargs)``.
        max_steps: an upper bound on the steps this runner will be asked for.
        precision: the Trainer's precision.
    """

    def __init__(self, name: str, module, batch: Callable[[int], Any], callback_kwargs: Dict[str, Any],
                 max_steps: int = 10_000, precision: str = "32-true", copy_module: bool = True) -> None:
        from lightning_ckpt import ActivationCheckpointing

        self.name = name
        self.module = copy.deepcopy(module) if copy_module else module
        self.callback = ActivationCheckpointing(**callback_kwargs)
        self.root = tempfile.mkdtemp(prefix="lckpt_bench_")
        self.times: List[float] = []  # seconds of every step, in order
        self.cpu: List[float] = []  # process CPU seconds of every step (one runner computes at a time)
        self.spans: List[Tuple[float, float]] = []  # (start, end) of every step, perf_counter seconds
        self.activations: List[Optional[int]] = []  # the step's measured activation bytes, None when not measured
        self.modes: List[tuple] = []  # the plan each step ran
        self.metrics: List[Optional[Dict[str, float]]] = []  # the callback's figures of each measured step, else None
        self.error: Optional[BaseException] = None
        self._left = 0
        self._stop = False
        self._go = threading.Semaphore(0)
        self._idle = threading.Semaphore(0)
        self._t0 = self._c0 = 0.0
        self._running: tuple = ()
        self._last_metrics: Dict[str, float] = {}
        self._batch, self._max_steps, self._precision = batch, max_steps, precision
        self.trainer = None
        self._thread = threading.Thread(target=self._fit, name=f"runner {name}", daemon=True)
        self._thread.start()
        self._idle.acquire()  # set up and waiting before its first batch
        self._raise()

    # ------------------------------------------------------------------------------------------ the fit thread
    def _fit(self) -> None:
        import lightning as L

        runner = self

        class First(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if runner._left == 0:
                    runner._hold(trainer)
                runner._c0, runner._t0 = time.process_time(), time.perf_counter()

        class Last(L.Callback):
            def on_before_backward(self, trainer, pl_module, loss):  # after the plugin's hooks: the step's plan
                plan = runner.callback.plan
                runner._running = tuple(plan.modes) if plan is not None else ()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                end = time.perf_counter()
                seconds = end - runner._t0
                runner.spans.append((runner._t0, end))
                runner.cpu.append(time.process_time() - runner._c0)
                runner.times.append(seconds)
                metrics = runner.callback.last_metrics
                measured = metrics is not runner._last_metrics  # the callback replaces the dict on a measured step
                runner._last_metrics = metrics
                reading = metrics.get(ACTIVATIONS) if measured else None
                runner.activations.append(None if reading is None else round(reading * GiB))
                runner.metrics.append(dict(metrics) if measured else None)
                runner.modes.append(runner._running)
                runner._left -= 1
                if runner._left == 0:
                    runner._hold(trainer)

        try:
            self.trainer = L.Trainer(
                accelerator="cpu", devices=1, max_steps=self._max_steps, max_epochs=-1, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=self.root, precision=self._precision,
                callbacks=[First(), self.callback, Last()])
            loader = torch.utils.data.DataLoader(_Batches(self._batch, self._max_steps), batch_size=None)
            self.trainer.fit(self.module, train_dataloaders=loader)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            self.error = err
        finally:
            self._stop = True
            self._idle.release()

    def _hold(self, trainer) -> None:
        """Hand control back to the main thread and wait for the next order (steps, or stop)."""
        if not self._stop:
            self._idle.release()
            self._go.acquire()
        if self._stop:  # Lightning ends the fit after the batch under way (if any), with its end-of-fit hooks
            trainer.should_stop = True

    # ------------------------------------------------------------------------------------------ the main thread
    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"runner {self.name!r} failed: {type(self.error).__name__}: {self.error}") \
                from self.error

    def run(self, steps: int = 1) -> List[float]:
        """Run ``steps`` steps of this configuration (nothing else computes meanwhile); their seconds."""
        if self._stop:
            self._raise()
            raise RuntimeError(f"runner {self.name!r} has stopped")
        before = len(self.times)
        self._left = steps
        self._go.release()
        self._idle.acquire()
        self._raise()
        return self.times[before:]

    def finish(self) -> str:
        """End the fit (the callback writes its report); the report's text as printed."""
        buffer = io.StringIO()
        if not self._stop:
            self._stop = True
            with contextlib.redirect_stdout(buffer):
                self._go.release()
                self._thread.join()
        self._raise()
        return buffer.getvalue()

    def report_json(self) -> Dict[str, Any]:
        """The end-of-fit report's JSON, as the callback wrote it (after :meth:`finish`)."""
        path = os.path.join(self.root, REPORT_FILE)
        if not os.path.exists(path):
            return {}
        with open(path) as fh:
            return json.load(fh)

    @property
    def calibrating(self) -> bool:
        """Whether the callback's budget calibration still runs (False for a fixed policy)."""
        calibration = self.callback.calibration
        if calibration is None:
            return False
        done = getattr(calibration, "done", None)
        if done is not None:
            return not done
        return len(self.modes) < 3 or len(set(self.modes[-3:])) > 1


# ------------------------------------------------------------------------------------------ schedules


def interleave(runners: Sequence[Runner], rounds: int, steps: int = 1, warmup: int = 1
               ) -> Tuple[Dict[str, List[float]], Dict[str, List[float]]]:
    """``warmup`` untimed rounds, then ``rounds`` rounds: every runner ``steps`` steps per round, the order rotated by
    one each round and reversed every other round, so that neighbours change and a slow drift of the machine
    cancels. Per runner, the wall seconds and the process CPU seconds of each round (the sum of its steps)."""
    wall: Dict[str, List[float]] = {r.name: [] for r in runners}
    cpu: Dict[str, List[float]] = {r.name: [] for r in runners}
    order = list(runners)
    for r in range(warmup + rounds):
        shift = r % len(order)
        this = order[shift:] + order[:shift]
        if r % 2:
            this.reverse()
        for runner in this:
            before = len(runner.cpu)
            seconds = sum(runner.run(steps))
            if r >= warmup:
                wall[runner.name].append(seconds)
                cpu[runner.name].append(sum(runner.cpu[before:]))
    return wall, cpu


def interleave_groups(groups: Dict[Any, Sequence[Runner]], rounds: int, warmup: int = 0, seed: int = 0
                      ) -> Tuple[Dict[Any, Dict[str, List[float]]], Dict[Any, Dict[str, List[float]]]]:
    """Like :func:`interleave`, but each round runs group after group, every member of a group one step, back to
    back: the ratios within a group pair steps at most ``len(group) - 1`` steps apart. A runner in several groups
    steps once in each. The groups' order rotates each round; the order inside each group is shuffled each round
    (seeded): rotated, every runner keeps its neighbours, and a step's time may depend on the step before it (on
    2026-12-08, rotated, the Llama's ``first:3`` in three Trainers read 6 % faster than ``first:3`` in three others
    placed elsewhere in the group, over 27 rounds). Per group, per runner: the wall and process CPU seconds of its
    step in each timed round."""
    rng = random.Random(seed)
    wall = {g: {r.name: [] for r in members} for g, members in groups.items()}
    cpu = {g: {r.name: [] for r in members} for g, members in groups.items()}
    keys = list(groups)
    for r in range(warmup + rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            members = list(groups[key])
            rng.shuffle(members)
            for runner in members:
                before = len(runner.cpu)
                seconds = sum(runner.run(1))
                if r >= warmup:
                    wall[key][runner.name].append(seconds)
                    cpu[key][runner.name].append(sum(runner.cpu[before:]))
    return wall, cpu


def block_names(module) -> List[str]:
    """The blocks the callback will find in ``module`` (its own detection)."""
    from lightning_ckpt.core.blocks import find_blocks

    return [name for name, _ in find_blocks(module)]


def paired(ours: Sequence[float], theirs: Sequence[float]) -> tuple:
    """Median over rounds of ours / theirs in the same round, and its range."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return statistics.median(ratios), min(ratios), max(ratios)


def instances_ratio(ours: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]]) -> float:
    """Ours / theirs where each configuration ran in several Trainers (each given as its seconds per round): the
    geometric mean, over every pair of one of our Trainers and one of theirs, of the median over rounds of their
    ratio in the same round. The pairing by round cancels the machine's drift, the median a slow step, and the mean
    over pairs each Trainer's own bias. With one Trainer each: the median of the per-round ratios."""
    logs = [math.log(statistics.median(a / b for a, b in zip(o, t))) for o in ours for t in theirs]
    return math.exp(statistics.fmean(logs))


def instances_interval(ours: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]], resamples: int = 2000,
                       seed: int = 0) -> Tuple[float, float]:
    """The 95 % bootstrap interval of :func:`instances_ratio` (rounds resampled with replacement, seeded): how far it
    could move on another run of the same rounds on this machine."""
    rng = random.Random(seed)
    rounds = range(len(ours[0]))
    values = []
    for _ in range(resamples):
        pick = rng.choices(rounds, k=len(rounds))
        values.append(instances_ratio([[o[i] for i in pick] for o in ours], [[t[i] for i in pick] for t in theirs]))
    values.sort()
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def measured_activations(runner: Runner) -> Optional[int]:
    """The last measured step's activation bytes of a runner (its callback's ``memory/activations_gib``)."""
    values = [a for a in runner.activations if a is not None]
    return values[-1] if values else None
