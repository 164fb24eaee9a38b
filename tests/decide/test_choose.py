"""Choose, check, choose again (:mod:`lightning_ckpt.decide.choose`), on constructed peaks."""

from __future__ import annotations

from lightning_ckpt.decide.choose import MAX_CHECKS, CheckedChoice, choose_checked

# candidates: name -> (predicted peak, true peak, seconds per step); the chooser trusts a checked peak over a prediction
CANDIDATES = {"none": (100, 130, 1.0), "half": (70, 75, 2.0), "all": (40, 40, 3.0)}


def _choose(limit: int, table=CANDIDATES):
    def choose(checked):
        peak = {name: checked.get(name, predicted) for name, (predicted, _, _) in table.items()}
        within = [name for name in table if peak[name] <= limit]
        return min(within, key=lambda n: table[n][2]) if within else min(table, key=peak.get)
    return choose


def _seconds(table=CANDIDATES):
    return lambda name: table[name][2]


def test_a_choice_settles_when_choosing_again_returns_a_candidate_already_checked():
    checks = []

    def check(name):
        checks.append(name)
        return CANDIDATES[name][1]

    chosen, peak = choose_checked(_choose(100), check, 100, _seconds())
    assert checks == ["none", "half"]  # none read 130 > 100: chosen again; half read 75: chosen again -> half
    assert (chosen, peak) == ("half", 75)


def test_peaks_known_before_the_choice_settle_it_without_a_check():
    chosen, peak = choose_checked(_choose(100), lambda name: 1 / 0, 100, _seconds(), checked={"none": 90})
    assert (chosen, peak) == ("none", 90)


def test_the_give_up_rule_takes_the_fastest_checked_within_the_limit_never_an_unchecked_one():
    # a chooser that keeps proposing something new (as the solver does when each check moves its predictions)
    peaks = {"a": 60, "b": 49, "c": 45, "d": 70, "e": 10}
    seconds = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 0.5, "e": 0.1}
    script = iter("abcde")
    checks = []

    def check(name):
        checks.append(name)
        return peaks[name]

    chosen, peak = choose_checked(lambda checked: next(script), check, 50, seconds.get)
    assert checks == list("abcd")[:MAX_CHECKS]  # "e" was proposed after the last check: never run
    assert (chosen, peak) == ("b", 49)  # within 50 and faster than "c"


def test_when_nothing_checked_fits_the_lowest_checked_peak_is_taken():
    table = {f"p{i}": (10, 100 - i, float(i)) for i in range(8)}
    choice = CheckedChoice(_choose(50, table), 50, _seconds(table), tries=3)
    proposed = []
    while True:
        candidate = choice.propose()
        if choice.settled is not None:
            break
        proposed.append(candidate)
        choice.record(candidate, table[candidate][1])
    assert choice.gave_up and len(proposed) == 3
    assert candidate == min(proposed, key=lambda n: table[n][1]) and candidate in choice.checked


def test_a_candidate_that_cannot_be_checked_is_returned_with_no_peak():
    chosen, peak = choose_checked(_choose(100), lambda name: None, 100, _seconds())
    assert (chosen, peak) == ("none", None)
