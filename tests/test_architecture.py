"""The package's shape: layers that import only downwards, a core that runs without Lightning, a small public API,
old names that still import (with a warning), strategies registered whichever is imported first."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import lightning_ckpt
from lightning_ckpt.lightning.port import PlanPort

PACKAGE = Path(lightning_ckpt.__file__).parent
LAYERS = ("core", "measure", "decide", "forecast", "lightning")  # data flows from left to right
# beside the layers: the command line reads the forecast layer; the demos are example models (Lightning too)
SIDE = {"cli": LAYERS.index("forecast"), "demos": len(LAYERS)}


def _rank(module: str) -> int:
    part = module.split(".")[1] if module.count(".") >= 1 else ""
    if part in LAYERS:
        return LAYERS.index(part)
    return SIDE.get(part, -1)  # lightning_ckpt itself: infrastructure


def _imports(path: Path):
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        yield name, path


def test_every_module_lives_in_a_layer_and_imports_only_downwards():
    offenders = []
    for name, path in _modules():
        rank = _rank(name)
        if name in ("lightning_ckpt", "lightning_ckpt.__main__"):
            continue
        assert rank >= 0, f"{name} is in no layer: put it in one of {LAYERS} (or cli/demos)"
        for imported in _imports(path):
            if imported.startswith("lightning_ckpt.") and _rank(imported) > rank:
                offenders.append(f"{name} imports {imported} (a higher layer)")
    assert not offenders, "\n".join(offenders)


def test_only_the_lightning_layer_and_the_demos_import_lightning():
    offenders = [f"{name} imports {imported}" for name, path in _modules() for imported in _imports(path)
                 if imported.split(".")[0] in ("lightning", "pytorch_lightning")
                 and _rank(name) not in (LAYERS.index("lightning"), SIDE["demos"])]
    assert not offenders, "\n".join(offenders)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_core_layers_import_and_run_with_lightning_blocked():
    code = """
import sys
sys.modules["lightning"] = None          # any import of Lightning now raises ImportError
sys.modules["pytorch_lightning"] = None
import torch
import lightning_ckpt
from lightning_ckpt import apply_policy, parse_policy, find_blocks, StepMeter
import lightning_ckpt.decide.budget, lightning_ckpt.decide.calibration, lightning_ckpt.decide.choose
import lightning_ckpt.decide.controller, lightning_ckpt.decide.verify
import lightning_ckpt.forecast.trace, lightning_ckpt.forecast.profile, lightning_ckpt.cli.main
from lightning_ckpt.demos.gpt import GPT, GPTConfig
model = GPT(GPTConfig.tiny())
plan = apply_policy(model, "every:2")
meter = StepMeter("cpu", model=model)
idx = torch.randint(0, 96, (2, 16))
with meter.step() as box:
    model(idx, idx)[1].backward()
assert box.reading.activations > 0 and plan.num_checkpointed == 2
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning")
                and sys.modules[m] is not None)
assert not loaded, loaded
print("ok")
"""
    proc = _run(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


ORDERS = {
    "lightning_ckpt first": ("import lightning_ckpt", "import lightning"),
    "lightning first": ("import lightning.pytorch", "import lightning_ckpt"),
    # the README's line: the callback's import is what loads Lightning, mid-way through lightning_ckpt's own import
    "the callback first": ("from lightning_ckpt import ActivationCheckpointing", "import lightning.pytorch"),
    # a strategy class named before Lightning is loaded: its module loads Lightning (it warned, registering nothing)
    "a strategy first": ("from lightning_ckpt import DDPActivationCheckpointingStrategy", "import lightning.pytorch"),
}


@pytest.mark.slow
@pytest.mark.parametrize("order", list(ORDERS))
def test_importing_the_package_registers_the_strategies_in_either_order(order):
    first, second = ORDERS[order]
    code = f"""
import warnings
warnings.simplefilter("error", RuntimeWarning)
{first}
{second}
from lightning.pytorch.strategies import StrategyRegistry
from lightning_ckpt import DDPActivationCheckpointingStrategy
assert StrategyRegistry["ddp_ac"]["strategy"] is DDPActivationCheckpointingStrategy
assert all(n in StrategyRegistry for n in ("single_device_ac", "ddp_spawn_ac", "ddp_fork_ac", "fsdp_ac"))
print("ok")
"""
    proc = _run(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_public_api_is_small_sorted_and_complete():
    names = lightning_ckpt.__all__
    assert names == sorted(names) and 12 <= len(names) <= 20, names
    for name in names:
        assert getattr(lightning_ckpt, name) is not None
    for error in ("ForeignCheckpointingError", "ReplaySafetyError", "EquivalenceError", "OutOfMemoryDiagnosis"):
        assert issubclass(getattr(lightning_ckpt, error), Exception)
    for internal in ("Controller", "preflight", "count_tokens", "format_bytes", "plan_model"):
        assert internal not in names


def test_every_module_declares_a_sorted_all():
    missing = []
    for name, path in _modules():
        tree = ast.parse(path.read_text())
        assigned = [n for n in tree.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == "__all__" for t in n.targets)]
        if not assigned and name not in ("lightning_ckpt.__main__",) and not name.endswith("__init__") \
                and path.name != "__init__.py":
            missing.append(name)
    assert not missing, missing


@pytest.mark.parametrize("old", ["plan_model", "plan_from_numbers", "Controller", "count_tokens", "LedgerInputs"])
def test_no_layer_for_names_that_never_shipped(old):
    """0.1 is the first release: the public API is ``__all__``, with no deprecated aliases of earlier drafts."""
    assert old not in dir(lightning_ckpt)
    with pytest.raises(AttributeError):
        getattr(lightning_ckpt, old)


@pytest.mark.slow
def test_no_module_aliases_for_paths_that_never_shipped():
    code = """
import importlib.util
import lightning_ckpt
for old in ("lightning_ckpt.wrap", "lightning_ckpt.trace", "lightning_ckpt.callback", "lightning_ckpt.planner"):
    assert importlib.util.find_spec(old) is None, old
from lightning_ckpt.forecast import numbers, trace
for module, old in ((numbers, "plan_from_numbers"), (trace, "plan_model")):
    assert not hasattr(module, old), old
print("ok")
"""
    proc = _run(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_an_unknown_top_level_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"), warnings.catch_warnings():
        lightning_ckpt.nope  # noqa: B018


def test_no_function_of_the_lightning_layer_is_longer_than_60_lines():
    """Short functions (issue 38): each function of ``lightning_ckpt/lightning`` fits in 60 lines of code, its
    docstring aside (the callback's arguments are declared with their help in one docstring). ``fit_start`` had 70."""
    import ast

    long = []
    for path in sorted((PACKAGE / "lightning").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) and \
                    isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str) else None
                lines = node.end_lineno - node.lineno + 1 - (doc.end_lineno - doc.lineno + 1 if doc else 0)
                if lines > 60:
                    long.append(f"{path.name}:{node.lineno} {node.name}: {lines} lines")
    assert not long, long


@pytest.mark.parametrize("module", ["gate", "shaped", "recovery", "budgeting", "autotoggle", "reporting", "measuring",
                                    "curves", "compiling", "verifying", "persistence"])
def test_the_per_shape_features_reach_the_run_through_the_port_only(module):
    """Issue 38: ``ShapeGate`` and ``ShapeSteps`` held the engine (``engine: Any``) and read its attributes (the
    calibration, the controller, the last result, ...). They hold a ``PlanPort`` now: the plan, the one way to change
    it, the model, the settings, the ranks, the capacity, the last ledger and messages to the user."""
    tree = ast.parse((PACKAGE / "lightning" / f"{module}.py").read_text())
    reached = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                      and isinstance(node.value, ast.Attribute) and node.value.attr == "port"})
    offered = {name for name, value in vars(PlanPort).items() if not name.startswith("_")}
    assert set(reached) <= offered, sorted(set(reached) - offered)
    assert not [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "engine"]


def test_the_engine_hears_its_features_through_one_interface():
    """Issue 38: the engine's step's end, fit end, report and teardown branched on each capability (``if
    self.calibration is not None``, ``if self.gate is not None``, ...), and its state_dict on the auto-toggle and the
    budget. Each capability is a ``Feature`` now (its checkpointed state under its ``state_key``), and those hooks
    call every feature the same way."""
    from lightning_ckpt.lightning.autotoggle import AutoToggle
    from lightning_ckpt.lightning.budgeting import BudgetFeature
    from lightning_ckpt.lightning.compiling import CompiledBlocks
    from lightning_ckpt.lightning.feature import Feature
    from lightning_ckpt.lightning.verifying import Verification

    assert all(issubclass(cls, Feature) for cls in (BudgetFeature, AutoToggle, CompiledBlocks, Verification))
    # the step's hooks branched on verify and on compiled blocks too (self._verified, self._breaks_before)
    capabilities = {"budget", "toggle", "calibration", "shapes", "controller", "gate", "verification", "compiled",
                    "_verified", "_verify", "_breaks_before", "_budget_state"}
    tree = ast.parse((PACKAGE / "lightning" / "engine.py").read_text())
    hooks = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    hooks_named = ("batch_start", "batch_end", "fit_end", "report", "release", "state_dict", "load_state_dict")
    reached = {f"{name}: self.{node.attr}" for name in hooks_named
               for node in ast.walk(hooks[name]) if isinstance(node, ast.Attribute) and node.attr in capabilities
               and isinstance(node.value, ast.Name) and node.value.id == "self"}
    assert not reached, sorted(reached)


def test_no_capability_is_made_or_named_by_the_engine_or_the_out_of_memory_guard():
    """Issue 38: the engine made the auto-toggle when it applied the plan and the budget at fit start, each by name,
    kept them as attributes, and handed the out-of-memory guard the calibration, the controller and the gate, whose
    retry then branched on each. Each feature says when it is made and whether a run wants it (``FEATURES``), and the
    guard asks every feature of a retry (``retries_out_of_memory``, ``escalated``)."""
    capabilities = {"budget", "toggle", "calibration", "shapes", "controller", "gate", "verification", "compiled"}
    classes = {"AutoToggle", "BudgetFeature", "CompiledBlocks", "Verification"}
    named = []
    for module in ("engine", "recovery"):
        tree = ast.parse((PACKAGE / "lightning" / f"{module}.py").read_text())
        named += [f"{module}.py:{node.lineno} self.{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in capabilities
                  and isinstance(node.value, ast.Name) and node.value.id == "self"]
        named += [f"{module}.py:{node.lineno} {node.func.id}(...)" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in classes]
    assert not named, named


def test_the_out_of_memory_guard_and_the_report_are_features_the_engine_never_names():
    """Issue 38: the engine made the guard by name, kept the step's phase for it (its own hooks moved a phase tracker
    the guard read) and called it by name at set-up, fit start, release and on an exception; the measurement handed
    each measured step to the report by name, and the engine printed it. The guard is a feature (last of
    ``FEATURES``): it hears the step's phases through the feature hooks (``phase_starts``) like any other; the report
    is one too (first: it hears of a measured step before the features that decide on it)."""
    from lightning_ckpt.lightning.engine import FEATURES
    from lightning_ckpt.lightning.feature import Feature
    from lightning_ckpt.lightning.recovery import StepGuard
    from lightning_ckpt.lightning.reporting import RunReport

    assert issubclass(StepGuard, Feature) and FEATURES[-1] is StepGuard
    assert issubclass(RunReport, Feature) and FEATURES[0] is RunReport
    tree = ast.parse((PACKAGE / "lightning" / "engine.py").read_text())
    measuring = ast.parse((PACKAGE / "lightning" / "measuring.py").read_text())
    named = [f"engine.py:{node.lineno} self.{node.attr}" for node in [*ast.walk(tree), *ast.walk(measuring)]
             if isinstance(node, ast.Attribute) and node.attr in ("guard", "phase", "tracker", "record")
             and isinstance(node.value, ast.Name) and node.value.id == "self"]
    named += [f"engine.py:{node.lineno} {node.id}" for node in ast.walk(tree)
              if isinstance(node, ast.Name) and node.id in ("PhaseTracker", "register_replay_hook")]
    assert not named, named


def test_each_feature_is_made_when_it_says_for_a_run_that_wants_it():
    from lightning_ckpt.lightning.autotoggle import AutoToggle
    from lightning_ckpt.lightning.compiling import CompiledBlocks
    from lightning_ckpt.lightning.curves import LoggedCurves
    from lightning_ckpt.lightning.engine import FEATURES, CheckpointingEngine
    from lightning_ckpt.lightning.recovery import StepGuard
    from lightning_ckpt.lightning.reporting import RunReport
    from lightning_ckpt.lightning.settings import Settings
    from lightning_ckpt.lightning.verifying import Verification

    assert [kind.made_at for kind in FEATURES] == ["engine", "engine", "engine", "engine", "fit", "plan", "engine"]
    plain = CheckpointingEngine(Settings(policy="every:2"))
    assert [type(f) for f in plain.features] == [RunReport, LoggedCurves, CompiledBlocks, StepGuard]
    checked = CheckpointingEngine(Settings(policy="every:2", verify=True, auto_threshold="1GiB", measure=False))
    # the auto-toggle is made with the plan; measure=False logs no curves
    assert [type(f) for f in checked.features] == [RunReport, Verification, CompiledBlocks, StepGuard]
    assert checked.feature(Verification) is checked.features[1] and checked.feature(AutoToggle) is None


def test_the_logged_curves_are_a_feature_and_the_step_reading_logs_nothing():
    """Issue 38: the step's measurement also warned of a missing logger, gave TensorBoard its layout, logged every
    logging step, settled the owed time of instrumented steps and asked for the fit's first step for the report, each
    in its own code. The logged curves are a feature (``LoggedCurves``, in ``FEATURES`` for runs with
    ``measure=True``), the report asks for its step like any feature (``step_needs``), and the step's reading
    (``measuring.py``) only reads, agrees across ranks and hands the step to the features."""
    from lightning_ckpt.lightning.curves import LoggedCurves
    from lightning_ckpt.lightning.engine import FEATURES
    from lightning_ckpt.lightning.feature import Feature
    from lightning_ckpt.lightning.reporting import RunReport

    assert issubclass(LoggedCurves, Feature) and LoggedCurves in FEATURES
    assert "step_needs" in vars(RunReport)
    tree = ast.parse((PACKAGE / "lightning" / "measuring.py").read_text())
    named = sorted({node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} & {
        "log_metrics", "log_step", "tensorboard_layout", "rank_zero_warn", "TensorBoardLogger"})
    named += sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} & {
        "_owed", "owed", "last_ledger", "prepare_loggers", "should_update_logs"})
    assert not named, named
