"""Fixtures shared by the test folders. The builders they hand out, and the helpers that are not
fixtures (``tiny()``, the event tables, process and ring checks), are in ``helpers/``: this
directory is on the import path because pytest imports this file from it (rootdir-less
``prepend`` mode, no ``__init__.py`` in the test folders)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.hooks import context as hctx
from harness.hooks import nvtx_ranges

from helpers import events

# torch and the engine (helpers.threads, helpers.capture) are imported in the fixtures that need
# them, not here: at the top they add ~5 s of start-up to every run of a folder that needs
# neither (measured: tests/test_config.py 0.7 s → 6.4 s).


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for the whole module, its module-scoped fixtures included (why: helpers.threads)."""
    from helpers.threads import one_thread

    with one_thread():
        yield


@pytest.fixture
def hooks_reset():
    """NVTX off and the hook context empty after the test, whatever it activated."""
    yield
    nvtx_ranges.disable()
    hctx.reset_for_tests()


@pytest.fixture
def tables():
    """The hand-built event tables of helpers.events: the grid (``session``, ``run``) and Case D (``case_d``)."""
    return SimpleNamespace(MS=events.MS, session=events.make_session, run=events.make_run, frames=events.frames_of,
                           case_d=events.case_d_table, NOMINAL=events.NOMINAL, GAP=events.GAP)


@pytest.fixture(scope="session")
def captured(tmp_path_factory):
    """One in-process ``--hooks capture`` of the tiny preset (helpers.capture), for the hook's and replay's tests."""
    from helpers.capture import capture_run
    from helpers.threads import one_thread

    with one_thread():
        try:
            return capture_run(tmp_path_factory.mktemp("capture"), "capture")
        finally:
            hctx.reset_for_tests()
