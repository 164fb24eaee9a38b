import math

import pytest

from lightning_ckpt.decide.controller import DEFAULT_LADDER, Controller, resolve_threshold

KiB, MiB, GiB = 2**10, 2**20, 2**30


def test_crossing_up_moves_one_rung_per_reading():
    c = Controller(threshold=10 * GiB)
    d = c.observe(11 * GiB)
    assert d.changed and d.level == 1 and d.policy == "every:2"
    assert "11.00 GiB > threshold 10.00 GiB" in d.reason
    d = c.observe(10.5 * GiB)
    assert d.changed and d.policy == "all"
    d = c.observe(12 * GiB)
    assert not d.changed and d.policy == "all" and "last policy 'all'" in d.reason


def test_a_small_models_reasons_print_sizes_in_the_unit_that_fits():
    """A 2-block model's activations are a few hundred KiB: its reasons name them, not '0.001 GiB > 0.000 GiB'."""
    up = Controller(threshold=300 * KiB).observe(1.2 * MiB)
    assert up.changed and "activation peak 1.2 MiB > threshold 300.0 KiB" in up.reason
    down = Controller(threshold=300 * KiB, cooldown=1, level=1).observe(100 * KiB)  # no ratio learned: 100 KiB
    assert down.changed and "predicted 100.0 KiB under 'none' stayed under the release level 240.0 KiB" in down.reason
    assert "GiB" not in up.reason + down.reason and "rung" not in up.reason + down.reason


def test_staying_below_threshold_at_the_bottom_never_switches():
    c = Controller(threshold=10 * GiB)
    assert not any(c.observe(r * GiB).changed for r in [1, 9.99, 5, 10, 0])
    assert c.switches == 0


def test_release_after_cooldown_uses_the_learned_ratio():
    c = Controller(threshold=10 * GiB, cooldown=3)
    c.observe(12 * GiB)  # none -> every:2
    c.observe(6 * GiB)  # at every:2 the same work measures half: ratio 2
    assert c.pair_ratio == {0: 2.0}
    # predicted one rung lower: 2 × 4.5 = 9 GiB > release 8 GiB → stay
    assert not any(c.observe(4.5 * GiB).changed for _ in range(10))
    # the workload shrinks: predicted 2 × 3.5 = 7 < 8, three calm steps then release
    decisions = [c.observe(3.5 * GiB) for _ in range(3)]
    assert [d.changed for d in decisions] == [False, False, True]
    assert decisions[-1].policy == "none" and "release level" in decisions[-1].reason


def test_oscillating_reading_makes_a_bounded_number_of_switches():
    c = Controller(threshold=10 * GiB, cooldown=5)
    readings = [(11 if i % 2 == 0 else 2) * GiB for i in range(200)]
    switched_at = [i for i, r in enumerate(readings) if c.observe(r).changed]
    assert len(switched_at) <= 200 // 5 + 2
    assert all(b - a > 1 for a, b in zip(switched_at, switched_at[1:])), "flapped on consecutive steps"


def test_readings_alternating_across_the_threshold_never_flap():
    c = Controller(threshold=10 * GiB, cooldown=4, ladder=("none", "all"))
    levels = [c.observe(r * GiB).level for r in [11, 9, 11, 9, 11, 9] * 10]
    # up once; the high readings keep the predicted lower reading above release: never down again
    assert levels[0] == 1 and set(levels) == {1} and c.switches == 1


def test_state_dict_round_trip_restores_the_rung():
    c = Controller(threshold=10 * GiB, cooldown=3)
    c.observe(11 * GiB)
    c.observe(5 * GiB)
    state = c.state_dict()
    assert all(isinstance(v, (int, float, str, list, dict, type(None))) for v in state.values())
    fresh = Controller(threshold=10 * GiB, cooldown=3)
    assert fresh.load_state_dict(state) == []
    assert fresh.level == 1 and fresh.policy == "every:2" and fresh.pair_ratio == {0: 2.2}
    other = Controller(threshold=10 * GiB, ladder=("none", "all"))
    assert "differs" in other.load_state_dict(state)[0]


def test_default_ladder():
    assert DEFAULT_LADDER == ("none", "every:2", "all")


@pytest.mark.parametrize(
    "value, capacity, expected",
    [("18GiB", None, 18 * GiB), ("512MiB", None, 512 * 2**20), (1000, None, 1000), (0.5, 24 * GiB, 12 * GiB),
     ("0.25", 8 * GiB, 2 * GiB), (1.0, 4 * GiB, 4 * GiB)],
)
def test_threshold_forms(value, capacity, expected):
    assert resolve_threshold(value, capacity) == expected


@pytest.mark.parametrize(
    "value, error, match",
    [
        (math.nan, ValueError, "fraction"),
        (-1, ValueError, "positive"),
        (0, ValueError, "positive"),
        (1.5, ValueError, r"\(0, 1\]"),
        ("18 parsecs", ValueError, "unknown unit"),
        (True, TypeError, "bool"),
        (None, TypeError, "not a size"),
        ("x", ValueError, "not a size"),
    ],
)
def test_bad_thresholds_are_rejected(value, error, match):
    with pytest.raises(error, match=match):
        resolve_threshold(value, 24 * GiB)


def test_fraction_without_capacity_says_how_to_fix():
    with pytest.raises(ValueError, match="capacity='24GiB'"):
        resolve_threshold(0.8, None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"threshold": 0}, "positive"),
        ({"threshold": GiB, "ladder": ["all"]}, "at least two"),
        ({"threshold": GiB, "release": 1.5}, "release"),
        ({"threshold": GiB, "cooldown": 0}, "cooldown"),
        ({"threshold": GiB, "level": 3}, "level from 0 to 2: level=3 is not a position"),
    ],
)
def test_bad_controller_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Controller(**kwargs)


@pytest.mark.parametrize("reading", [math.nan, -1.0, True, "1GiB"])
def test_bad_readings(reading):
    with pytest.raises(ValueError, match="reading"):
        Controller(threshold=GiB).observe(reading)


# ------------------------------------------------------------------------------ out-of-memory marks, resume


def _escalated(c: Controller, failed: int, to: int) -> None:
    """What the out-of-memory escalation does: the plan moves up to ``to`` and the controller hears of it."""
    c.level, c.since_switch, c.calm_steps = to, 0, 0
    c.out_of_memory(failed)


def test_a_policy_that_ran_out_of_memory_is_not_chosen_again_until_the_reading_shows_room():
    """'none' ran out of memory and the step was retried under 'every:2' (reading 5 GiB): calm readings far under
    the threshold do not take the controller back to 'none' (the old controller went back after ``cooldown`` steps,
    into the same error); a reading that fell below the release share of the failed step's does."""
    c = Controller(threshold=100 * GiB, cooldown=2)
    _escalated(c, failed=0, to=1)
    assert not any(c.observe(5 * GiB).changed for _ in range(50))
    assert not any(c.observe(4.1 * GiB).changed for _ in range(10))  # above 0.8 x 5 GiB: no room shown
    assert c.level == 1 and "ran out of memory" in c.observe(4.5 * GiB).reason
    decisions = [c.observe(3.9 * GiB) for _ in range(2)]  # under 4 GiB: the step would now fit with margin
    assert decisions[-1].changed and decisions[-1].policy == "none"


def test_the_mark_is_the_first_reading_after_the_retry_and_survives_a_resume():
    c = Controller(threshold=100 * GiB, cooldown=1)
    _escalated(c, failed=0, to=1)
    saved = c.state_dict()  # before any reading: the mark is still to be taken
    resumed = Controller(threshold=100 * GiB, cooldown=1)
    assert resumed.load_state_dict(saved) == []
    resumed.observe(5 * GiB)
    assert resumed.state_dict()["out_of_memory"] == {"0": [1, 5.0 * GiB]}
    again = Controller(threshold=100 * GiB, cooldown=1)
    again.load_state_dict(resumed.state_dict())
    assert not any(again.observe(4.5 * GiB).changed for _ in range(10))


def test_no_ratio_is_learnt_across_an_escalation():
    """The controller moved down 2 -> 1 (a pending reading at 2); 1 ran out of memory and the plan went back to 2.
    The next reading is not a measurement of the pair (1, 2), and (2, 3) does not exist."""
    c = Controller(threshold=10 * GiB, cooldown=1, level=2)
    assert c.observe(1 * GiB).changed and c.level == 1
    _escalated(c, failed=1, to=2)
    c.observe(1 * GiB)
    assert c.pair_ratio == {}


def test_resume_keeps_the_reading_pending_after_a_move():
    """A run saved right after a move up resumes with the reading taken before the move: the next reading teaches
    the ratio, so the resumed run stays up where the uninterrupted run stays up."""
    threshold = 80 * KiB
    c = Controller(threshold=threshold, cooldown=2)
    assert c.observe(90 * KiB).changed  # none -> every:2, pending (0, 90 KiB)
    resumed = Controller(threshold=threshold, cooldown=2)
    resumed.load_state_dict(c.state_dict())
    for controller in (c, resumed):
        levels = [controller.observe(45 * KiB).level for _ in range(6)]  # predicted 90 KiB one lower: stay
        assert levels == [1] * 6 and controller.pair_ratio == {0: 2.0}
