import pytest


@pytest.fixture(autouse=True)
def _hooks_test(one_thread, hooks_reset):
    """Every hooks test on one thread (tiny ops), and leaving no hook active for the next."""
