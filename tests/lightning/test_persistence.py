"""What a checkpoint keeps of the run, and where each part goes back (``SavedRun``), on a port of the test's own."""

from types import SimpleNamespace

from lightning_ckpt.lightning.feature import Feature
from lightning_ckpt.lightning.persistence import SavedRun

NAMES = ["layers.0", "layers.1"]


class Plan:
    names = NAMES

    def state_dict(self):
        return {"policy": "every:2", "names": NAMES, "modes": ["recompute", "off"]}


class Port:
    """The plan, the settings and what the restore did to the plan."""

    owner = "ActivationCheckpointing"

    def __init__(self, budget=None):
        spec = SimpleNamespace(spec="every:2")
        self.settings = SimpleNamespace(start=spec, budget=SimpleNamespace(spec=budget) if budget else None)
        self.plan, self.calls = Plan(), []

    def restore_plan(self, state):
        self.calls.append(("restore_plan", state["policy"]))

    def change_plan(self, policy, level=None):
        self.calls.append(("change_plan", policy))


class Kept(Feature):
    def __init__(self, key, calls):
        self.state_key, self.calls, self.loaded = key, calls, None

    def state_dict(self):
        return {"from": self.state_key}

    def load_state_dict(self, state):
        self.loaded = state
        self.calls.append(("load", self.state_key))


def _saved(budget=None, controller=None):
    state = {"version": 1, "policy": "every:2", "plan_policy": "every:2", "names": NAMES,
             "modes": ["recompute", "off"]}
    if controller is not None:
        state["controller"] = controller
    if budget is not None:
        state["budget"] = budget
    return state


def test_the_auto_toggles_rung_goes_back_before_the_plan_and_a_budgets_state_after_it():
    port = Port()
    saved = SavedRun(port)
    toggle = Kept("controller", port.calls)
    saved.run_starts()
    saved.load_state_dict(_saved(controller={"level": 1}, budget={"calibration": 1}))  # before the plan exists
    assert port.calls == []
    saved.plan_applied([toggle])
    assert port.calls == [("load", "controller"), ("restore_plan", "every:2")]
    budget, later = Kept("budget", port.calls), Kept("budget", port.calls)
    saved.made(budget)  # this fit's budget, made at its start, takes the state; nothing is left for another
    saved.made(later)
    assert budget.loaded == {"calibration": 1} and later.loaded is None


def test_a_checkpoint_restored_after_fit_start_goes_into_this_fits_budget():
    """FSDP, ModelParallelStrategy and DeepSpeed restore after their set-up, after fit start: the budget made there
    takes the state (it used to wait for the next fit, and this one calibrated again)."""
    port = Port(budget="budget:3MiB")
    saved = SavedRun(port)
    saved.run_starts()
    saved.plan_applied([])
    budget = Kept("budget", port.calls)
    saved.made(budget)
    assert budget.loaded is None  # nothing restored yet when the budget is made
    saved.load_state_dict(_saved(budget={"calibration": 1}) | {"policy": "budget:3MiB"})
    assert budget.loaded == {"calibration": 1}
    assert port.calls == [("restore_plan", "every:2"), ("load", "budget")]


def test_a_budget_of_an_earlier_fit_takes_no_state_and_no_stale_state_is_saved_again():
    port = Port()
    saved = SavedRun(port)
    earlier = Kept("budget", port.calls)
    saved.made(earlier)  # made by an earlier fit
    saved.run_starts()
    saved.plan_applied([])  # this run has no auto-toggle: the checkpoint's rung has nowhere to go
    saved.load_state_dict(_saved(controller={"level": 1}))
    assert earlier.loaded is None
    assert "controller" not in saved.state_dict([])  # not written into every later checkpoint of this run
    state = saved.state_dict([Kept("controller", port.calls)])
    assert state["controller"] == {"from": "controller"} and state["policy"] == "every:2"


def test_a_checkpoint_of_another_policy_keeps_the_configured_plan_and_says_how_to_resume(recwarn):
    port = Port()
    port.owner = "DDPActivationCheckpointingStrategy"
    saved = SavedRun(port)
    saved.run_starts()
    saved.plan_applied([])
    saved.load_state_dict(_saved() | {"policy": "all"})
    (warning,) = [w for w in recwarn if "configured policy wins" in str(w.message)]
    assert "DDPActivationCheckpointingStrategy(policy='every:2')" in str(warning.message)
    assert "pass policy='all'" in str(warning.message)
    assert port.calls == [("change_plan", port.settings.start)]
