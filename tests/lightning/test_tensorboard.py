"""What the callback's measurement leaves in TensorBoard: event files, custom-scalars layout, a live server.

Runs ``Trainer.fit`` on the CPU with a ``TensorBoardLogger`` and reads the event files back with TensorBoard's
own ``EventAccumulator`` (and, once, over the HTTP data API of a real ``tensorboard`` process).
"""

from __future__ import annotations

import csv
import glob
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from _lightning_models import SEQ, TinyTransformer, trainer_kwargs
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_ckpt.lightning.callback import TENSORBOARD_LAYOUT, ActivationCheckpointing

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.custom_scalar import layout_pb2  # noqa: E402
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402

# what a CPU run logs, and what only an allocator (CUDA) can give
CPU_TAGS = {
    "memory/params_gib",
    "memory/grads_gib",
    "memory/optimizer_gib",
    "memory/activations_gib",
    "memory/autocast_copies_gib",  # measured: 0 in float32, never left out as unknown on the CPU
    "memory/peak_forward_gib",  # on the CPU from the exact reference step's live-tensor count
    "memory/peak_backward_gib",
    "memory/peak_optimizer_gib",
    "throughput/tokens_per_sec",
    "throughput/samples_per_sec",
    "time/step_s",
    "checkpointing/blocks",
}
CUDA_ONLY_TAGS = {
    "memory/peak_allocated_gib",
    "memory/peak_reserved_gib",
    "memory/other_gib",
    "memory/cache_gib",
}
_OUR_ROOTS = ("memory/", "throughput/", "time/", "checkpointing/")
BATCH = 8


def _event_file(root) -> str:
    files = glob.glob(os.path.join(str(root), "**", "events.out.tfevents.*"), recursive=True)
    assert len(files) == 1, files
    return files[0]


def _accumulator(root) -> EventAccumulator:
    acc = EventAccumulator(_event_file(root), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _layout(acc: EventAccumulator) -> layout_pb2.Layout:
    """The custom-scalars layout as TensorBoard's plugin reads it: a serialized ``Layout`` in a string
    tensor."""
    tag = custom_scalar_metadata.CONFIG_SUMMARY_TAG
    assert tag in acc.Tags()["tensors"]
    assert acc.SummaryMetadata(tag).plugin_data.plugin_name == custom_scalar_metadata.PLUGIN_NAME
    events = acc.Tensors(tag)
    assert len(events) == 1  # written once
    raw = tensor_util.make_ndarray(events[0].tensor_proto)
    return layout_pb2.Layout.FromString(raw.item() if raw.shape == () else raw.flat[0])


def _fit(tmp_path, policy="every:2", **overrides):
    cb = ActivationCheckpointing(policy=policy, prefix=overrides.pop("prefix", ""))
    kwargs = dict(
        max_steps=5,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(str(tmp_path), name="tb"),
    )
    kwargs.update(overrides)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, **kwargs))
    trainer.fit(TinyTransformer(batch_size=BATCH))
    return trainer, cb


# ------------------------------------------------------------------------------------------- event files


@pytest.mark.parametrize(("accumulate", "every"), [(1, 1), (2, 2), (2, 1)])
def test_event_files_hold_every_cpu_tag_at_the_expected_steps(tmp_path, accumulate, every):
    steps = 5
    trainer, cb = _fit(tmp_path, max_steps=steps, accumulate_grad_batches=accumulate, log_every_n_steps=every)
    assert trainer.global_step == steps  # optimizer steps
    acc = _accumulator(tmp_path)
    ours = {t for t in acc.Tags()["scalars"] if t.startswith(_OUR_ROOTS)}
    assert ours == CPU_TAGS  # no peak_allocated/peak_reserved/other/cache on the CPU: absent, not zero
    assert not ours & CUDA_ONLY_TAGS

    # one point per logged *optimizer* step, at Lightning's step index (log_every_n_steps counts optimizer
    # steps)
    expected = [k for k in range(steps) if (k + 1) % every == 0]
    series = {}
    for tag in sorted(CPU_TAGS):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == expected, tag
        series[tag] = [e.value for e in events]
    assert [e.step for e in acc.Scalars("train_loss")] == expected  # the same steps as Lightning's own metric

    tokens_per_step = accumulate * BATCH * SEQ  # every micro-batch of the optimizer step counted
    for i in range(len(expected)):
        step_s = series["time/step_s"][i]
        assert step_s > 0
        assert series["throughput/tokens_per_sec"][i] * step_s == pytest.approx(tokens_per_step, rel=1e-5)
        assert series["throughput/samples_per_sec"][i] * step_s == pytest.approx(accumulate * BATCH, rel=1e-5)
        assert series["checkpointing/blocks"][i] == cb.plan.num_checkpointed == 2
        assert series["memory/activations_gib"][i] > 0
        assert series["memory/params_gib"][i] == series["memory/grads_gib"][i] > 0
        assert series["memory/optimizer_gib"][i] > series["memory/params_gib"][i]  # Adam: two moments


def test_custom_scalars_layout_puts_the_ledger_in_one_memory_chart(tmp_path):
    # three steps: the first two are reference steps, whose time and throughput come from the third
    _fit(tmp_path, max_steps=3, log_every_n_steps=1, prefix="ac")
    acc = _accumulator(tmp_path)
    layout = _layout(acc)
    assert [c.title for c in layout.category] == ["Memory", "Throughput", "Phases", "Checkpointing"]
    phases = layout.category[2]
    phase_tags = [f"ac/memory/peak_{p}_gib" for p in ("forward", "backward", "optimizer")]
    assert list(phases.chart[0].multiline.tag) == phase_tags
    memory = layout.category[0]
    assert len(memory.chart) == 1 and memory.chart[0].WhichOneof("content") == "multiline"
    memory_tags = list(memory.chart[0].multiline.tag)
    assert set(memory_tags) == {
        f"ac/memory/{k}_gib"
        for k in (
            "params",
            "grads",
            "optimizer",
            "optimizer_master",
            "activations",
            "autocast_copies",
            "peak_allocated",
            "peak_reserved",
            "other",
            "cache",
        )
    }
    charted = [t for c in layout.category for chart in c.chart for t in chart.multiline.tag]
    # every line the run logged is drawn somewhere (multiline tags are regular expressions in TensorBoard)
    logged = [t for t in acc.Tags()["scalars"] if t.startswith("ac/")]
    assert set(logged) == {f"ac/{t}" for t in CPU_TAGS}
    for tag in logged:
        assert any(re.fullmatch(pattern, tag) for pattern in charted), tag
    throughput = {chart.title: list(chart.multiline.tag) for chart in layout.category[1].chart}
    assert ["ac/throughput/tokens_per_sec"] in throughput.values()
    assert "ac/memory/peak_backward_gib" in layout.category[2].chart[0].multiline.tag
    assert "ac/checkpointing/blocks" in layout.category[3].chart[0].multiline.tag


def test_default_layout_constant_matches_what_is_written(tmp_path):
    _fit(tmp_path, max_steps=1, log_every_n_steps=1)
    layout = _layout(_accumulator(tmp_path))
    written = {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category}
    expected = {
        cat: {title: spec[1] for title, spec in charts.items()} for cat, charts in TENSORBOARD_LAYOUT.items()
    }
    assert written == expected


def test_any_logger_works_csv_beside_tensorboard(tmp_path):
    loggers = [CSVLogger(str(tmp_path), name="csv"), TensorBoardLogger(str(tmp_path), name="tb")]
    _fit(tmp_path, max_steps=4, log_every_n_steps=2, logger=loggers)
    with open(os.path.join(loggers[0].log_dir, "metrics.csv")) as fh:
        rows = list(csv.DictReader(fh))
    columns = set(rows[0])
    assert CPU_TAGS <= columns and not columns & CUDA_ONLY_TAGS
    ours = [r for r in rows if r["memory/activations_gib"]]
    assert [int(r["step"]) for r in ours] == [1, 3]
    acc = _accumulator(tmp_path / "tb")  # the layout went to the TensorBoard logger only
    assert _layout(acc).category[0].title == "Memory"
    assert [e.step for e in acc.Scalars("memory/activations_gib")] == [1, 3]
    for row, event in zip(ours, acc.Scalars("memory/activations_gib")):
        assert float(row["memory/activations_gib"]) == pytest.approx(event.value, rel=1e-6)


def test_plot_curves_renders_the_run(tmp_path):
    """``examples/plot_curves.py`` (which draws ``docs/memory_curves.png``) on a fresh run's event files."""
    pytest.importorskip("matplotlib")
    import importlib.util
    from pathlib import Path

    _fit(tmp_path, max_steps=3, log_every_n_steps=1)
    script = Path(__file__).resolve().parents[2] / "examples" / "plot_curves.py"
    spec = importlib.util.spec_from_file_location("_plot_curves", script)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    run = plot.newest_run(str(tmp_path / "tb"))
    assert run.endswith("version_0")
    out = tmp_path / "curves.png"
    drawn = plot.render(plot.read_scalars(run), str(out))
    phases = {f"memory/peak_{p}_gib" for p in ("forward", "backward", "optimizer")}  # the "Phases" chart's
    assert set(drawn) == CPU_TAGS - {"throughput/samples_per_sec", "time/step_s"} - phases
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------- a real server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.fixture
def tensorboard_server(tmp_path):
    """Start ``tensorboard`` on a free local port for ``tmp_path/tb``; always stopped afterwards."""
    procs = []

    def start(logdir: str) -> str:
        port = _free_port()
        log = open(tmp_path / "tensorboard.log", "wb")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                logdir,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--load_fast",
                "false",
                "--reload_interval",
                "0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append((proc, log))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.flush()
                raise AssertionError(
                    f"tensorboard exited with {proc.returncode}: "
                    f"{(tmp_path / 'tensorboard.log').read_text()[-2000:]}"
                )
            try:
                if _get_json(base + "/data/runs"):  # up, and the run is loaded
                    return base
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError("tensorboard did not answer within 120 s")
            time.sleep(0.5)

    yield start
    for proc, log in procs:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
        log.close()


@pytest.mark.slow
def test_a_tensorboard_server_serves_the_activation_curve_and_the_layout(tmp_path, tensorboard_server):
    _fit(tmp_path, max_steps=4, log_every_n_steps=1)
    acc = _accumulator(tmp_path)
    base = tensorboard_server(str(tmp_path / "tb"))

    runs = _get_json(base + "/data/runs")
    assert runs == ["version_0"]
    query = urllib.parse.urlencode({"tag": "memory/activations_gib", "run": runs[0]})
    points = _get_json(f"{base}/data/plugin/scalars/scalars?{query}")  # [[wall_time, step, value], ...]
    assert [p[1] for p in points] == [0, 1, 2, 3]
    assert [p[2] for p in points] == pytest.approx([e.value for e in acc.Scalars("memory/activations_gib")])
    assert all(p[2] > 0 for p in points)

    tags = _get_json(f"{base}/data/plugin/scalars/tags")[runs[0]]
    assert CPU_TAGS <= set(tags) and not CUDA_ONLY_TAGS & set(tags)

    layout = _get_json(base + "/data/plugin/custom_scalars/layout")
    titles = [c["title"] for c in layout["category"]]
    assert titles == ["Memory", "Throughput", "Phases", "Checkpointing"]
    phase_tags = layout["category"][2]["chart"][0]["multiline"]["tag"]
    assert phase_tags == [f"memory/peak_{p}_gib" for p in ("forward", "backward", "optimizer")]
    memory_tags = layout["category"][0]["chart"][0]["multiline"]["tag"]
    assert {"memory/activations_gib", "memory/params_gib", "memory/grads_gib", "memory/optimizer_gib"} <= set(
        memory_tags
    )


def test_every_line_the_callback_can_log_is_charted_by_the_layout():
    """Every key a step can log — each ledger line filled (master copies and phase peaks included), the throughput
    and time lines, the level, a budget plan's per-block lines — matches a tag of some chart, with and without a
    prefix (``memory/optimizer_master_gib`` was logged and charted nowhere)."""
    from types import SimpleNamespace

    from lightning_ckpt.lightning.metrics import block_metrics, tensorboard_layout
    from lightning_ckpt.measure.ledger import Ledger
    from lightning_ckpt.measure.monitor import StepResult

    ledger = Ledger(params=1, grads=2, optimizer=3, master=1, activations=4, autocast_copies=5, peak_allocated=6,
                    peak_reserved=7, other=8, cache=9, phase_peaks={"forward": 1, "backward": 2, "optimizer": 3})
    choice = SimpleNamespace(kept=1, replay=2)
    plan = SimpleNamespace(choices=[(choice, None)] * 12)
    for prefix in ("", "ac"):
        root = f"{prefix}/" if prefix else ""
        logged = {**StepResult(None, ledger, 10, 2, 0.5, 3).metrics(prefix), f"{root}checkpointing/level": 1.0,
                  **block_metrics(plan, prefix)}
        assert f"{root}memory/optimizer_master_gib" in logged
        charted = [t for category in tensorboard_layout(prefix).values() for _, tags in category.values()
                   for t in tags]
        missing = [tag for tag in logged if not any(re.fullmatch(pattern, tag) for pattern in charted)]
        assert not missing, missing
