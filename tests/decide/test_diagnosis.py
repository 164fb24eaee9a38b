import pytest
import torch

from lightning_ckpt.decide.diagnosis import PHASES, OutOfMemoryDiagnosis, PhaseTracker, diagnose, is_out_of_memory


def test_tracker_walks_the_phases_and_knows_the_first_optimizer_step():
    t = PhaseTracker()
    seen = []
    for _ in range(2):
        t.batch_start()
        seen.append(t.phase)
        t.forward_start()
        seen.append(t.phase)
        t.forward_start()  # a second module's forward in the same step
        seen.append(t.phase)
        t.backward_start()
        seen.append(t.phase)
        t.optimizer_step_start()
        seen.append(t.phase)
        t.optimizer_step_end()
    assert seen == ["before_forward", "forward", "forward", "backward", "first_optimizer_step"] + [
        "before_forward", "forward", "forward", "backward", "optimizer_step"]
    fresh = PhaseTracker()
    fresh.load_state_dict(t.state_dict())
    fresh.optimizer_step_start()
    assert fresh.phase == "optimizer_step"


@pytest.mark.parametrize(
    "phase, words",
    [
        ("before_forward", "parameters, inputs, initialization"),
        ("forward", "retained activations"),
        ("backward", "replay transient"),
        ("first_optimizer_step", "lazy optimizer-state allocation"),
        ("optimizer_step", "fragmentation"),
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
    assert len(PHASES) == 5


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
