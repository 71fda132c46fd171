"""Case E on GPUs that DiT and VAE ranks share: without CUDA MPS their processes time-slice the
GPU (measured on an H200: decode 399 → 904 ms, DiT 2377 → 2842 ms), so serve says so."""

from __future__ import annotations

from harness.drivers.launcher import mps_running, shared_gpus, sharing_warning

SHARED = {"dit": ["cuda:0", "cuda:1"], "vae": ["cuda:1", "cuda:0"]}
SEPARATE = {"dit": ["cuda:0"], "vae": ["cuda:1"]}
CPU = {"dit": ["cpu", "cpu"], "vae": ["cpu", "cpu"]}


def test_shared_gpus_are_the_cuda_devices_of_both_roles():
    assert shared_gpus(SHARED) == ["cuda:0", "cuda:1"]
    assert shared_gpus(SEPARATE) == [] and shared_gpus(CPU) == []


def test_only_case_e_on_shared_gpus_without_mps_is_warned():
    note = sharing_warning(SHARED, "case-e", mps=False)
    assert note is not None and "cuda:0, cuda:1" in note and "MPS" in note and "\n" not in note
    assert sharing_warning(SHARED, "case-e", mps=True) is None
    assert sharing_warning(SHARED, "case-d", mps=False) is None  # serial anyway: nothing to overlap
    assert sharing_warning(SEPARATE, "case-e", mps=False) is None
    assert sharing_warning(CPU, "case-e", mps=False) is None


def test_mps_is_found_by_its_control_pipe(tmp_path):
    assert not mps_running({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    (tmp_path / "control").touch()
    assert mps_running({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
