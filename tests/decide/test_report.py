"""The end-of-fit report's phase table and the seed's advice per phase (pure formatting, hand-made ledgers)."""

from __future__ import annotations

import json

import pytest

from lightning_ckpt.decide.report import ledger_report, phase_advice, report_text
from lightning_ckpt.measure.ledger import Ledger

KiB, MiB, GiB = 2**10, 2**20, 2**30


def _ledger(forward, backward, optimizer, activations=3 * GiB, capacity=None):
    return Ledger(params=2 * GiB, grads=2 * GiB, optimizer=4 * GiB, activations=activations, capacity=capacity,
                  phase_peaks={"forward": forward, "backward": backward, "optimizer": optimizer})


@pytest.mark.parametrize("peaks, activations, phase, dominant, words", [
    ((11, 10, 9), 3, "forward", "optimizer", "Checkpointing lowers only the activations here, not the optimizer line"),
    ((13, 10, 9), 5, "forward", "activations", "checkpointing (or a smaller micro-batch) is the lever"),
    ((9, 17, 9), 3, "backward", "rest", "replay adds its interior"),
    ((9, 10, 14), 3, "optimizer", "temporaries", "Checkpointing will not help here"),
])
def test_the_advice_follows_the_phase_that_peaks(peaks, activations, phase, dominant, words):
    ledger = _ledger(*(p * GiB for p in peaks), activations=activations * GiB)
    assert ledger.peak_phase == phase and ledger.phase_dominant() == dominant
    advice = phase_advice(ledger)
    assert advice.startswith(f"The step peaks in the {phase} phase ({max(peaks):.2f} GiB")
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
    assert "  phase peak                 GiB   % of capacity  largest line" in text
    assert "  optimizer                14.00           87.5%  temporaries  <- the step's peak" in text
    assert "  forward                   9.00           56.2%  optimizer" in text
    assert "capacity 16.00 GiB" in text


def test_without_phase_peaks_there_is_no_phase_table():
    ledger = Ledger(params=GiB, grads=GiB, optimizer=GiB, activations=GiB)
    assert ledger.peak_phase is None and phase_advice(ledger) is None
    assert "phase peak" not in report_text(ledger_report(ledger, "none", ("none", "all")))


def test_a_small_models_report_prints_its_lines_in_the_unit_that_fits():
    """A 2-block model's ledger is a few hundred KiB: one unit for the table, from its largest line, in the header;
    the advice names sizes with theirs. Not 'params 0.000' under 'GiB'."""
    ledger = Ledger(params=300 * KiB, grads=300 * KiB, optimizer=600 * KiB, activations=1536 * KiB,
                    autocast_copies=150 * KiB, optimizer_by_dtype={"float32": 600 * KiB}, master=100 * KiB,
                    phase_peaks={"forward": 2 * MiB, "backward": 2.5 * MiB,
                                                            "optimizer": 1.75 * MiB})
    data = ledger_report(ledger, "none", ("none", "all"))
    assert data["lines"]["params"] == {"bytes": 300 * KiB, "gib": 300 * KiB / GiB, "share_of_capacity": None}
    text = report_text(data)
    assert "  line                       MiB\n" in text and "  phase peak                 MiB  largest line" in text
    assert "  params                    0.29\n" in text and "  activations               1.50  <- dominant" in text
    assert "  autocast_copies           0.15\n" in text
    assert "    optimizer float32       0.59\n" in text and "    master copies           0.10\n" in text  # same column
    assert "  backward                  2.50  activations  <- the step's peak" in text
    assert "The step peaks in the backward phase (2.5 MiB; forward 2.0 MiB, optimizer 1.8 MiB)" in text
    assert "0.000" not in text and "GiB" not in text
    # the table reads the bytes, so the JSON written beside the logs prints the same when loaded back
    assert report_text(json.loads(json.dumps(data))) == text


def test_a_tiny_report_falls_back_to_bytes_and_kib():
    ledger = Ledger(params=512, grads=512, optimizer=1024, activations=900)
    text = report_text(ledger_report(ledger, "none", ("none", "all")))
    assert "  line                       KiB\n" in text and "  params                    0.50\n" in text


def test_the_remedies_priced_from_the_ledger_lead_the_advice_and_join_the_json():
    """The report prices plan --remedies' rows from its own ledger: the JSON carries them under plan's keys, the
    table lists the run and every row that lowers its peak with its verdict, and the advice opens with the line
    that crosses and the remedy to try first."""
    from lightning_ckpt.forecast.measured import measured_remedies
    from lightning_ckpt.forecast.remedies import RunFacts

    p = 1_300_000_000
    state = 16 * p
    ledger = Ledger(params=2 * p, grads=2 * p, optimizer=12 * p, master=4 * p, activations=2 * GiB,
                    capacity=16 * GiB, optimizer_by_dtype={"float32": 12 * p},
                    phase_peaks={"forward": state + 2 * GiB, "backward": state + 2 * GiB, "optimizer": state})
    facts = RunFacts(params=p, trainable=p, width=2048, blocks=24, micro_batch=2, optimizer="adamw")
    data = ledger_report(ledger, "none", ("none", "all"), remedies=measured_remedies(ledger, facts))
    assert {"remedies", "recommended", "recommended_any", "remedy"} <= set(data)
    assert data["recommended"] == "optimizer-state offload" and data["remedy"]["line"] == "optimizer state"
    assert data["advice"][0].startswith("The optimizer state line crosses 16.00 GiB: checkpointing cannot help.")
    text = report_text(data)
    assert "  remedies priced from this ledger (GiB on one GPU; lower peaks than the run's):" in text
    assert "  none (as it runs)                                    19.37    2.00   21.37  does not fit\n" in text
    assert "  8-bit optimizer state                                12.15    2.00   14.15  fits, changes the training" \
        in text
    assert "  optimizer-state offload                               2.42    2.00    7.35  fits  <- try first" in text
    assert report_text(json.loads(json.dumps(data))) == text
    assert "remedies" not in ledger_report(ledger, "none", ("none", "all"))  # none given: no section
