"""The arguments, validated before any training: an argument that acts only together with another warns when given
without it (issue 38: arguments that only mean something together), and stays silent where it acts."""

import warnings

import pytest

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.lightning.strategy import SingleDeviceActivationCheckpointingStrategy


@pytest.mark.parametrize("given, needs", [
    (dict(cooldown=5), "auto_threshold"),
    (dict(release=0.5), "auto_threshold"),
    (dict(decide_every_n_steps=10), "auto_threshold"),
    (dict(ladder=["none", "all"]), "on_oom='escalate'"),
    (dict(max_shape="4x128"), "policy='budget:18GiB'"),
    (dict(per_shape=False), "a budget policy or auto_threshold"),
])
def test_an_argument_that_acts_only_with_another_says_so_when_given_alone(given, needs):
    ((name, value),) = given.items()
    with pytest.warns(UserWarning, match="leave .* out") as caught:
        ActivationCheckpointing(policy="every:2", **given)
    (message,) = [str(w.message) for w in caught if "leave" in str(w.message)]
    assert needs in message and f"leave {name} out" in message and f"{name}={value!r}" in message
    assert caught[0].filename == __file__  # it points at the user's line


@pytest.mark.parametrize("given", [
    dict(auto_threshold="1GiB", cooldown=5, release=0.5, decide_every_n_steps=10, ladder=["none", "all"],
         per_shape=False),
    dict(on_oom="escalate", ladder=["none", "all"]),
    dict(policy="budget:1GiB", max_shape="4x128", per_shape=False),
    dict(policy="every:2", cooldown=20, release=0.8, per_shape=True),  # the defaults, spelled out (LightningCLI does)
])
def test_arguments_given_where_they_act_say_nothing(given):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ActivationCheckpointing(**given)


def test_a_strategy_says_it_too():
    with pytest.warns(UserWarning, match=r"leave release out: release=0\.5 does nothing"):
        SingleDeviceActivationCheckpointingStrategy(policy="all", release=0.5, device="cpu")


def test_settings_replaced_say_nothing_again():
    """``Settings.replace`` passes every argument again (the ladder normalised, a benchmark's changes): the user heard
    of what they gave when they gave it."""
    settings = ActivationCheckpointing(policy="every:2").settings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings.replace(measure=False, decide_every_n_steps=10**9)


def test_the_run_reads_whether_an_argument_acts_from_the_same_table_that_warns():
    """The engine wrote the ladder's rule again (the policies a run may reach); it asks the settings now."""
    from lightning_ckpt.lightning.settings import Settings

    assert Settings(policy="all", on_oom="escalate").acts("ladder")
    assert Settings(policy="all", auto_threshold="1GiB").acts("ladder")
    assert not Settings(policy="all").acts("ladder")
    assert Settings(policy="budget:1GiB").acts("max_shape") and not Settings(policy="all").acts("max_shape")
