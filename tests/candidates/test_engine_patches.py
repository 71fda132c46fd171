"""EnginePatches: engine patches applied in registry order whatever the user's order, every revert
kept and run last first; a failing patch takes back the ones before it."""

from __future__ import annotations

import pytest

from harness import candidates as C


def _registry(monkeypatch, log: list, fail: str | None = None) -> None:
    """Three fake candidates T1 < T2 < T3 in registry order; T2 patches both the VAE and the
    output path. Every patch and revert writes what it did to ``log``."""

    def patch(cid: str, what: str):
        def apply(target, arg):
            if cid == fail:
                raise RuntimeError(f"{cid} failed")
            log.append(("patch", cid, what, target, arg))
            return lambda: log.append(("revert", cid, what))

        return apply

    fakes = {
        "T1": C.Candidate(id="T1", name="one", description="", gate="exact", patch_vae=patch("T1", "vae")),
        "T2": C.Candidate(id="T2", name="two", description="", gate="exact", patch_vae=patch("T2", "vae"),
                          patch_output=patch("T2", "output"), arg_choices=("a", "b"), default_arg="a"),
        "T3": C.Candidate(id="T3", name="three", description="", gate="exact", patch_output=patch("T3", "output")),
    }
    monkeypatch.setattr(C, "MODULES", {cid: f"fake_{cid}" for cid in fakes})
    monkeypatch.setattr(C, "get", fakes.__getitem__)


def test_patches_apply_in_registry_order_and_revert_in_reverse(monkeypatch):
    log: list = []
    _registry(monkeypatch, log)
    patches = C.EnginePatches(["T3", "T2:b", "T1"])  # the user's order is not the registry's
    applied = patches.apply(vae="V", output="O")
    assert applied == ["T1", "T2", "T2", "T3"]
    assert log == [("patch", "T1", "vae", "V", ""), ("patch", "T2", "vae", "V", "b"),
                   ("patch", "T2", "output", "O", "b"), ("patch", "T3", "output", "O", "")]
    assert [cid for cid, _ in patches.reverts] == applied  # every revert kept

    log.clear()
    patches.revert()
    assert log == [("revert", "T3", "output"), ("revert", "T2", "output"), ("revert", "T2", "vae"),
                   ("revert", "T1", "vae")]
    assert patches.reverts == []


def test_only_the_given_targets_are_patched(monkeypatch):
    log: list = []
    _registry(monkeypatch, log)
    assert C.EnginePatches(["T3", "T2"]).apply(output="O") == ["T2", "T3"]
    assert [(e[1], e[2], e[4]) for e in log] == [("T2", "output", "a"), ("T3", "output", "")]  # T2's default argument


def test_a_failing_patch_takes_back_the_ones_before_it(monkeypatch):
    log: list = []
    _registry(monkeypatch, log, fail="T3")
    patches = C.EnginePatches(["T3", "T1", "T2"])
    with pytest.raises(RuntimeError, match="T3 failed"):
        patches.apply(vae="V", output="O")
    assert [e[:3] for e in log] == [("patch", "T1", "vae"), ("patch", "T2", "vae"), ("patch", "T2", "output"),
                                    ("revert", "T2", "output"), ("revert", "T2", "vae"), ("revert", "T1", "vae")]
    assert patches.reverts == []


def test_every_revert_runs_when_one_fails(monkeypatch):
    log: list = []
    _registry(monkeypatch, log)
    patches = C.EnginePatches(["T1", "T3"])
    patches.apply(vae="V", output="O")

    def broken():
        raise OSError("revert failed")

    patches.reverts.insert(1, ("T2", broken))
    log.clear()
    with pytest.raises(OSError, match="revert failed"):
        patches.revert()
    assert log == [("revert", "T3", "output"), ("revert", "T1", "vae")]


def test_a_patch_without_a_revert_is_refused(monkeypatch):
    monkeypatch.setattr(C, "MODULES", {"T1": "fake"})
    monkeypatch.setattr(C, "get", {"T1": C.Candidate(id="T1", name="one", description="", gate="exact",
                                                      patch_dit=lambda target, arg: None)}.__getitem__)
    with pytest.raises(TypeError, match="T1: its patch returned None"):
        C.EnginePatches(["T1"]).apply(dit=object())


def test_real_registry_order(monkeypatch):
    """The real registry: the order of ``MODULES``, whatever the order given."""
    assert [c.id for c, _ in C.EnginePatches(["H6a", "H2a", "H4b"]).chosen] == ["H2a", "H4b", "H6a"]
