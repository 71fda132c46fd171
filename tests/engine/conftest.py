import pytest


@pytest.fixture(scope="module", autouse=True)
def _engine_module(one_thread):
    """Every engine module on one thread: the tiny model's ops are far too small to split."""
