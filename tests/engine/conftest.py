import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are far too small to split (the convs take ATen's single-threaded
    slow path anyway); a second thread on a shared 2-core box only adds contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
