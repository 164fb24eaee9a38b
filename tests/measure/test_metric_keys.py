"""The one registry of metric keys: the layout, the reduction across ranks and the documentation come from it, and a
key logged that it lacks fails the test that logged it (pyproject's ``filterwarnings`` makes the warning an error)."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_ckpt.measure.metric_keys import (
    CHARTS,
    METRIC_KEYS,
    MetricKey,
    UnregisteredMetricKey,
    combines_by_sum,
    find,
    tensorboard_layout,
    unregistered,
)

ROOT = Path(__file__).resolve().parents[2]


def _layout_before_the_registry(prefix):
    """The layout as lightning/metrics.py wrote it out by hand before the registry (the figure must not change)."""
    root = f"{prefix}/" if prefix else ""
    memory = [f"{root}memory/{k}_gib" for k in
              ("peak_allocated", "peak_reserved", "activations", "autocast_copies", "params", "grads", "optimizer",
               "optimizer_master", "other", "cache")]
    return {
        "Memory": {"ledger (GiB)": ["Multiline", memory]},
        "Throughput": {"tokens/s": ["Multiline", [f"{root}throughput/tokens_per_sec"]],
                       "samples/s": ["Multiline", [f"{root}throughput/samples_per_sec"]],
                       "step time (s)": ["Multiline", [f"{root}time/step_s"]]},
        "Phases": {"peak per phase (GiB)": ["Multiline", [f"{root}memory/peak_{phase}_gib"
                                                          for phase in ("forward", "backward", "optimizer")]]},
        "Checkpointing": {"blocks and level": ["Multiline", [f"{root}checkpointing/blocks",
                                                             f"{root}checkpointing/level"]],
                          "kept per block (GiB)": ["Multiline", [rf"{root}blocks/\d+_kept_gib"]],
                          "replay peak per block (GiB)": ["Multiline", [rf"{root}blocks/\d+_replay_gib"]]},
    }


@pytest.mark.parametrize("prefix", ["", "ac", "run/a"])
def test_the_layout_from_the_registry_is_the_layout_written_before(prefix):
    layout = tensorboard_layout(prefix)
    assert layout == _layout_before_the_registry(prefix)
    assert list(layout) == ["Memory", "Throughput", "Phases", "Checkpointing"]


def test_keys_are_found_with_or_without_a_prefix_and_per_block():
    assert find("memory/activations_gib").unit == "GiB"
    assert find("ac/memory/activations_gib") is find("memory/activations_gib")
    assert find("a/b/blocks/07_kept_gib").name == r"blocks/\d+_kept_gib"
    assert find("blocks/x_kept_gib") is None and find("memory/activation_gib") is None
    assert find("memory/activations_gib_extra") is None
    assert combines_by_sum("ac/throughput/tokens_per_sec") and combines_by_sum("throughput/samples_per_sec")
    assert not combines_by_sum("time/step_s") and not combines_by_sum("memory/peak_forward_gib")
    assert not combines_by_sum("unknown/key")  # what the engine reduces of its own (a flag): the largest rank's
    assert unregistered(["memory/params_gib", "memory/paramz_gib", "ac/shape/length"]) == ["memory/paramz_gib"]


def test_every_key_is_charted_or_deliberately_alone_and_every_chart_has_keys():
    assert {k.chart for k in METRIC_KEYS if k.chart} == set(CHARTS)
    names = [k.name for k in METRIC_KEYS]
    assert len(names) == len(set(names))
    with pytest.raises(ValueError, match="combine='mean'.*'max', 'sum', 'rank'"):
        MetricKey("x/y", "GiB", "mean")


def test_the_documentations_list_is_the_registry():
    """docs/measurement.md's "Metric keys" table names every registered key, and no other."""
    text = (ROOT / "docs" / "measurement.md").read_text()
    table = text[text.index("## Metric keys"):]
    table = table[:table.index("\n## ", 3)]
    documented = {name for row in table.splitlines() if row.startswith("| `")
                  for name in re.findall(r"`([a-z_]+/[A-Za-z_]+)`", row.split("|")[1])}
    assert documented == {k.documented_as for k in METRIC_KEYS}


def test_a_key_the_registry_lacks_warns_when_logged():
    from lightning_ckpt.lightning.metrics import log_metrics

    logged = []
    trainer = SimpleNamespace(is_global_zero=True, global_step=3,
                              loggers=[SimpleNamespace(log_metrics=lambda values, step: logged.append(values))])
    log_metrics(trainer, {"memory/activations_gib": 1.0}, "", step=2)
    with pytest.warns(UnregisteredMetricKey, match="'memory/activation_gib', a metric key its registry lacks"):
        log_metrics(trainer, {"memory/activation_gib": 1.0}, "", step=2)
    assert logged[-1] == {"memory/activation_gib": 1.0}  # logged all the same: a user's figures are never dropped
