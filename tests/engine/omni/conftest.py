"""vLLM-Omni tests: they need the ``vllm`` extra. Without it they skip, except where
HARNESS_REQUIRE_VLLM=1 (CI), where a missing or wrong install is a failure, not a skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.engine.omni import compat


@pytest.fixture(scope="session")
def extra() -> None:
    """Skips (or, under HARNESS_REQUIRE_VLLM=1, fails) the test when the vllm extra is not usable."""
    if compat.available():
        return
    versions = ", ".join(f"{d} {v or 'absent'}" for d, v in compat.installed_versions().items())
    if os.environ.get("HARNESS_REQUIRE_VLLM") == "1":
        pytest.fail(f"HARNESS_REQUIRE_VLLM=1 but the vllm extra is not usable ({versions})")
    pytest.skip(f"the vllm extra is not installed ({versions}): {compat.INSTALL_HINT}")


@pytest.fixture(scope="session")
def lingbot(extra):
    """vLLM-Omni's LingBot modules on the CPU platform, imported once per test session (30-60 s).
    This directory's tests run last (``pytest_collection_modifyitems`` below), so whatever vLLM
    changes at import (it patches inductor, for one) cannot reach the other tests of a whole-suite run."""
    return compat.import_lingbot()


@pytest.fixture(scope="module")
def omni_dist(lingbot):
    """vLLM-Omni's distributed state (gloo, one rank) for a module's transformers; torn down after."""
    compat.init_distributed()
    yield
    compat.shutdown_distributed()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Moves this directory's tests after every other test (a stable sort: each keeps its order)."""
    here = Path(__file__).parent
    items.sort(key=lambda item: item.path.is_relative_to(here))
