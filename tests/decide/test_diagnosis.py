import pytest
import torch

from lightning_ckpt.decide.diagnosis import PHASES, OutOfMemoryDiagnosis, PhaseTracker, diagnose, is_out_of_memory


def test_tracker_walks_the_phases_and_asks_the_optimizer_whether_its_step_is_the_first():
    t = PhaseTracker()
    seen = []
    for has_state in (False, True):
        t.batch_start()
        seen.append(t.phase)
        t.forward_start()
        seen.append(t.phase)
        t.forward_start()  # a second module's forward in the same step
        seen.append(t.phase)
        t.backward_start()
        seen.append(t.phase)
        t.optimizer_ready(has_state)
        t.optimizer_step_start()
        seen.append(t.phase)
        t.optimizer_step_end()
    assert seen == ["before_forward", "forward", "forward", "backward", "first_optimizer_step"] + [
        "before_forward", "forward", "forward", "backward", "optimizer_step"]
    # a second fit with a fresh optimizer: its first step, whatever this tracker saw before (the old count said later)
    t.optimizer_ready(False)
    t.optimizer_step_start()
    assert t.phase == "first_optimizer_step"
    assert not hasattr(t, "state_dict")  # nothing to save: a resumed optimizer says it by its state


@pytest.mark.parametrize("stage, phase", [("sanity_check", "sanity_check"), ("validate", "validation"),
                                          ("test", "evaluation"), ("predict", "evaluation"), ("train", "forward"),
                                          (None, "forward")])
def test_an_evaluation_loop_is_its_own_phase_whatever_the_block_hooks_set(stage, phase):
    t = PhaseTracker()
    t.forward_start()  # block 0's hook fires in validation too
    assert t.where(stage) == phase


def test_under_compile_before_forward_is_the_forward():
    t = PhaseTracker()
    assert t.where("train", compiled=False) == "before_forward"
    assert t.where("train", compiled=True) == "forward"
    t.backward_start()
    assert t.where("train", compiled=True) == "backward"


@torch.library.custom_op("lightning_ckpt_tests::ran_out", mutates_args=())
def _ran_out(x: torch.Tensor) -> torch.Tensor:
    """An allocation that fails inside whatever calls it (a custom op: opaque to the compiler, as a kernel is)."""
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


@_ran_out.register_fake
def _(x):
    return torch.empty_like(x)


def _error_of(fn, *args):
    try:
        fn(*args)
    except torch.OutOfMemoryError as err:
        return err
    raise AssertionError("no error")


def test_an_error_from_inside_a_compiled_call_is_told_from_an_eager_one():
    from lightning_ckpt.decide.diagnosis import raised_in_compiled_code

    x = torch.ones(2)
    assert raised_in_compiled_code(_error_of(torch.compile(lambda t: _ran_out(t * 2), backend="eager"), x))
    # the custom op's own eager path goes through dynamo's *disable* context: not compiled code
    assert not raised_in_compiled_code(_error_of(lambda t: _ran_out(t * 2), x))


@pytest.mark.parametrize("phase", ["validation", "sanity_check", "evaluation"])
def test_an_evaluation_phase_gets_no_checkpointing_advice(phase):
    text = diagnose(phase, {"params": 2.42, "optimizer": 9.69}, capacity=24 * 2**30,
                    phase_peaks={"forward": 2**30, "backward": 2**31})
    assert "checkpointing cannot help" in text and "Checkpoint more" not in text
    assert "batch size" in text and f"during the {phase.replace('_', ' ')} phase" in text
    assert "Phase peaks" not in text  # the training step's phases are not this loop's
    assert "No training step was measured" in diagnose(phase)


@pytest.mark.parametrize(
    "phase, words",
    [
        ("before_forward", "parameters, inputs, initialization"),
        ("forward", "retained activations"),
        ("backward", "replay transient"),
        ("first_optimizer_step", "lazy optimizer-state allocation"),
        ("optimizer_step", "fragmentation"),
        ("validation", "validation batch size"),
        ("sanity_check", "num_sanity_val_steps"),
        ("evaluation", "test or predict"),
    ],
)
def test_each_phase_names_the_seed_suspect(phase, words):
    text = diagnose(phase, {"params": 2.42, "optimizer": 9.69}, capacity=24 * 2**30)
    assert words in text and phase.replace("_", " ") in text
    assert "      9.69 GiB" in text and "40.4%" in text and "of 24.00 GiB capacity" in text


def test_no_ledger_yet_and_bad_phase():
    assert "No step was measured" in diagnose("forward")
    with pytest.raises(ValueError, match="not one of"):
        diagnose("warmup")
    assert len(PHASES) == 8


def test_diagnosis_is_an_oom_chained_to_the_original():
    original = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError) as err:
        try:
            raise original
        except torch.OutOfMemoryError as e:
            raise OutOfMemoryDiagnosis(diagnose("forward"), "forward") from e
    assert err.value.__cause__ is original and err.value.phase == "forward"
    assert is_out_of_memory(original) and not is_out_of_memory(ValueError("x"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate"))


def test_phase_peaks_say_which_phase_crossed_capacity():
    from lightning_ckpt.decide.diagnosis import diagnose

    GiB = 2**30
    peaks = {"forward": 10 * GiB, "backward": 12 * GiB, "optimizer": 17 * GiB}
    text = diagnose("optimizer_step", {"params_gib": 4.0}, capacity=16 * GiB, phase_peaks=peaks)
    assert "Phase peaks of the last measured step: forward 10.00 GiB (62%)" in text
    assert "The optimizer peak crossed capacity." in text
    text = diagnose("forward", None, capacity=16 * GiB, phase_peaks=peaks)
    assert "this error came in the forward phase, which had fit" in text
    text = diagnose("backward", None, capacity=20 * GiB, phase_peaks=peaks)
    assert "the backward phase peaked 8.00 GiB below it" in text
    assert "Phase peaks" not in diagnose("backward", None, capacity=20 * GiB)


def test_a_small_models_diagnosis_prints_sizes_in_the_unit_that_fits():
    """A small model's ledger (GiB values, as logged) and phase peaks read in KiB / MiB, not '0.000 GiB'."""
    KiB, MiB, GiB = 2**10, 2**20, 2**30
    ledger = {"params": 300 * KiB / GiB, "activations": 1.5 * MiB / GiB}
    peaks = {"forward": 2 * MiB, "backward": 1536 * KiB, "optimizer": 700 * KiB}
    text = diagnose("backward", ledger, capacity=4 * MiB, phase_peaks=peaks)
    assert "Phase peaks of the last measured step: forward 2.0 MiB (50%), backward 1.5 MiB (38%), optimizer " \
           "700.0 KiB (17%)." in text
    assert "the backward phase peaked 2.5 MiB below it" in text
    assert "Ledger at the last measured step of 4.0 MiB capacity:" in text
    assert "  params                       0.29 MiB  (  7.3%)" in text  # one unit, the largest line's
    assert "  activations                  1.50 MiB  ( 37.5%)" in text
    assert "GiB" not in text and "0.000" not in text


@pytest.mark.parametrize("message", [
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN Frontend error: [cudnn_frontend] Error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
])
def test_a_library_whose_allocation_failed_ran_out_of_memory(message):
    """cuBLAS and cuDNN allocate outside the caching allocator; their failures are retried like the allocator's."""
    assert is_out_of_memory(RuntimeError(message))


@pytest.mark.parametrize("message", [
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k)`",
    "cuDNN error: CUDNN_STATUS_BAD_PARAM",
    "CUDA error: an illegal memory access was encountered",
])
def test_other_library_errors_are_not_out_of_memory(message):
    assert not is_out_of_memory(RuntimeError(message))


def test_the_remedy_priced_from_the_ledger_comes_right_after_the_phase():
    text = diagnose("first_optimizer_step", {"optimizer": 9.69}, capacity=16 * 2**30,
                    remedy="Try optimizer-state offload first: it takes that line from 9.69 GiB to 0 B.")
    first, second = text.split("\n")[:2]
    assert first.startswith("lightning_ckpt: CUDA out of memory during the first optimizer step phase")
    assert second == "Try optimizer-state offload first: it takes that line from 9.69 GiB to 0 B."
