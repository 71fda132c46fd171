"""One in-process capture of the tiny preset (DiT at SP 1, VAE on one rank, the uint8 conversion),
shared by the capture and replay tests: the engines run exactly as the workers run them, under
``activate(...)``, without the cost of launching five processes."""

from __future__ import annotations

import pytest
import torch

from harness.hooks import context as hctx

from capture_helpers import capture_run


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only contends on a shared box
    yield
    torch.set_num_threads(n)
    hctx.reset_for_tests()


@pytest.fixture(scope="session")
def captured(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return capture_run(tmp_path_factory.mktemp("capture"), "capture")
    finally:
        torch.set_num_threads(n)
        hctx.reset_for_tests()
