"""The end-of-fit report's phase table and the seed's advice per phase (pure formatting, hand-made ledgers)."""

from __future__ import annotations

import pytest

from lightning_ckpt.decide.report import ledger_report, phase_advice, report_text
from lightning_ckpt.measure.ledger import Ledger

GiB = 2**30


def _ledger(forward, backward, optimizer, activations=3 * GiB, capacity=None):
    return Ledger(params=2 * GiB, grads=2 * GiB, optimizer=4 * GiB, activations=activations, capacity=capacity,
                  phase_peaks={"forward": forward, "backward": backward, "optimizer": optimizer})


@pytest.mark.parametrize("peaks, phase, dominant, words", [
    ((11, 10, 9), "forward", "optimizer", "checkpointing (or a smaller micro-batch) is the lever"),
    ((9, 17, 9), "backward", "rest", "replay adds its interior"),
    ((9, 10, 14), "optimizer", "temporaries", "Checkpointing will not help here"),
])
def test_the_advice_follows_the_phase_that_peaks(peaks, phase, dominant, words):
    ledger = _ledger(*(p * GiB for p in peaks))
    assert ledger.peak_phase == phase and ledger.phase_dominant() == dominant
    advice = phase_advice(ledger)
    assert advice.startswith(f"The step peaks in the {phase} phase ({max(peaks):.3f} GiB")
    assert f"the {dominant} line is the largest" in advice and words in advice


def test_phase_lines_add_up_to_the_phase_peak():
    ledger = _ledger(11 * GiB, 13 * GiB, 14 * GiB)
    for phase in ("forward", "backward", "optimizer"):
        assert sum(ledger.phase_lines(phase).values()) == ledger.phase_peaks[phase]
    assert ledger.phase_lines("optimizer")["temporaries"] == 6 * GiB
    assert ledger.phase_lines("backward")["rest"] == 2 * GiB


def test_report_table_marks_the_peak_phase_with_shares_of_capacity():
    data = ledger_report(_ledger(9 * GiB, 10 * GiB, 14 * GiB, capacity=16 * GiB), "all", ("none", "all"))
    assert data["peak_phase"] == "optimizer" and data["phases"]["optimizer"]["share_of_capacity"] == 14 / 16
    text = report_text(data)
    assert "optimizer         14.000           87.5%  temporaries  <- the step's peak" in text
    assert "forward            9.000           56.2%  optimizer" in text


def test_without_phase_peaks_there_is_no_phase_table():
    ledger = Ledger(params=GiB, grads=GiB, optimizer=GiB, activations=GiB)
    assert ledger.peak_phase is None and phase_advice(ledger) is None
    assert "phase peak" not in report_text(ledger_report(ledger, "none", ("none", "all")))
