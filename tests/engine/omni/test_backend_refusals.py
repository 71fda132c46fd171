"""``--engine vllm-omni`` refusals: one line, exit 2, nothing started or written. These need no
extra: a missing or unsupported install is simulated."""

from __future__ import annotations

import pytest

from harness import cli
from harness.engine.omni import compat


def _serve(tmp_path, capsys, *extra) -> tuple[int, str]:
    out = tmp_path / "run"
    rc = cli.main(["serve", "--engine", "vllm-omni", "--no-progress", "--out", str(out), *extra])
    assert not out.exists(), "a refused run must not create its run directory"
    return rc, capsys.readouterr().err.strip()


@pytest.fixture
def installed(monkeypatch):
    def set_versions(vllm, omni):
        monkeypatch.setattr(compat, "installed_versions", lambda: {"vllm": vllm, "vllm-omni": omni})
    return set_versions


def test_without_the_extra_fails_at_once_with_the_install_command(tmp_path, capsys, installed):
    installed(None, None)
    rc, err = _serve(tmp_path, capsys, "--sp", "1")
    assert rc == 2 and err.count("\n") == 0
    assert "pip install -e '.[vllm]'" in err and "vllm-omni" in err


def test_an_unsupported_version_is_refused_by_name(tmp_path, capsys, installed):
    installed("0.30.0", "0.29.1")
    rc, err = _serve(tmp_path, capsys, "--sp", "1")
    assert rc == 2 and "vllm-omni 0.29.1" in err and "0.30.0" in err


def test_sp_above_one_is_refused(tmp_path, capsys, installed):
    installed("0.30.0", "0.30.0")
    rc, err = _serve(tmp_path, capsys)  # the tiny preset has sp = 2
    assert rc == 2 and "sp = 2" in err and "NCCL" in err


@pytest.mark.parametrize("mode", ["compiled", "deterministic"])
def test_a_non_eager_mode_is_refused(tmp_path, capsys, installed, mode):
    """Its block runner is built with enforce_eager: a compiled run would be recorded as compiled
    and run eager."""
    installed("0.30.0", "0.30.0")
    rc, err = _serve(tmp_path, capsys, "--sp", "1", "--mode", mode)
    assert rc == 2 and err.count("\n") == 0
    assert f"mode = {mode}" in err and "eager" in err and "--mode eager" in err


# H1b's default kernel (cuDNN) needs CUDA and is refused for that first on CPU; math runs anywhere
@pytest.mark.parametrize("cand", ["H1a", "H1b:math", "H2a"])
def test_engine_patching_candidates_are_refused(tmp_path, capsys, installed, cand):
    installed("0.30.0", "0.30.0")
    rc, err = _serve(tmp_path, capsys, "--sp", "1", "--candidate", cand)
    assert rc == 2 and f"candidate {cand.split(':')[0]}" in err and "reference DiT" in err


def test_reference_stays_the_default():
    from harness.config import load_preset

    assert load_preset("tiny").engine.backend == "reference"
