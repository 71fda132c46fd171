import hashlib
import re

import numpy as np
import pytest

from harness.measure import gates as G

STEP = 1 / 127.5  # one uint8 level in [-1, 1]


def _arrays(epoch, chunk):
    rng = np.random.default_rng(epoch * 100 + chunk)
    latent = rng.normal(size=(16, 3, 6, 8)).astype(np.float32)
    pixels = rng.integers(0, 256, size=(12, 16, 24, 3), dtype=np.uint8)
    return latent, pixels


def make_run(root, name, epochs=3, chunks=2, edit=None):
    """Epochs 0-1 saved, every epoch hashed; ``edit(epoch, chunk, latent, pixels)`` may perturb."""
    run = root / name
    for e in range(epochs):
        for c in range(chunks):
            latent, pixels = _arrays(e, c)
            if edit:
                latent, pixels = edit(e, c, latent.copy(), pixels.copy())
            G.record_chunk(run, e, c, latent, pixels)
    return run


def test_layout_and_hashes(tmp_path):
    run = make_run(tmp_path, "a")
    assert G.list_outputs(run) == [
        f"epoch{e}/chunk{c:02d}.{w}.npy" for e in (0, 1) for c in (0, 1) for w in ("latent", "pixels")
    ]
    assert G.chunk_path(run, 1, 3, "pixels").as_posix().endswith("outputs/epoch1/chunk03.pixels.npy")
    recs = G.read_hashes(run)
    assert [(r.epoch, r.chunk) for r in recs] == [(e, c) for e in range(3) for c in range(2)]
    # A record hashes the raw C-order bytes: what a process holding only the array (driver,
    # encoder) can compute without writing a file.
    f = G.chunk_path(run, 1, 1, "latent")
    latent, pixels = _arrays(1, 1)
    assert recs[3].latent_sha256 == hashlib.sha256(latent.tobytes()).hexdigest() == G.array_sha256(np.load(f))
    assert np.array_equal(np.load(f), latent)
    assert G.hash_record(1, 1, latent, pixels) == recs[3]
    # Non-contiguous input hashes like its contiguous copy.
    assert G.array_sha256(pixels[:, ::2]) == hashlib.sha256(np.ascontiguousarray(pixels[:, ::2]).tobytes()).hexdigest()
    with pytest.raises(ValueError):
        G.save_chunk_outputs(run, 0, 0, latent.astype(np.float64), pixels)
    with pytest.raises(ValueError):
        G.save_chunk_outputs(run, 0, 0, latent, pixels[..., :2])


def test_identical_runs_pass_both_gates(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    for kind in ("exact", "threshold"):
        r = G.gate(a, b, kind)
        assert r.passed, r.verdict
        assert r.verdict.startswith("pass") and r.n_failed == 0
        assert r.n_compared == 8 + 6


# ---- array metrics just inside / just outside each threshold ----------------------------------


def _check_latent(a, b):
    return G.latent_passes(G.latent_metrics(a, b))


def test_latent_rel_l2_threshold():
    a = np.ones(10_000, np.float32)
    # A uniform offset δ gives rel-L2 = δ and stays far inside allclose (tolerance 0.06).
    assert _check_latent(a, a + np.float32(0.0099)) == []
    reasons = _check_latent(a, a + np.float32(0.0101))
    assert len(reasons) == 1 and reasons[0].startswith("rel_l2")


def test_latent_allclose_atol():
    a = np.ones(10_000, np.float32)  # ‖a‖ = 100: a single outlier barely moves rel-L2
    a[0] = 0.0  # tolerance here is atol alone: 0.03
    inside, outside = a.copy(), a.copy()
    inside[0], outside[0] = 0.0299, 0.0301
    assert _check_latent(a, inside) == []
    reasons = _check_latent(a, outside)
    assert len(reasons) == 1 and "allclose" in reasons[0]
    assert G.latent_metrics(a, outside)["rel_l2"] < 0.001


def test_latent_allclose_rtol():
    a = np.ones(10_000, np.float32)
    a[0] = 10.0  # tolerance: 0.03 + 0.03 * 10 = 0.33
    inside, outside = a.copy(), a.copy()
    inside[0], outside[0] = 10.329, 10.331
    assert _check_latent(a, inside) == []
    assert "allclose" in _check_latent(a, outside)[0]
    # The tolerance scales with the reference (run A): reversed, the reference is 10.331 and its
    # tolerance 0.03 + 0.03 · 10.331 ≈ 0.340 covers the same 0.331 difference.
    assert G.latent_metrics(a, outside)["allclose_excess"] > 0
    assert G.latent_metrics(outside, a)["allclose_excess"] <= 0 and _check_latent(outside, a) == []


def test_latent_nan_and_inf_fail():
    a = np.ones(100, np.float32)
    for bad in (np.nan, np.inf):
        b = a.copy()
        b[5] = bad
        assert "non-finite" in _check_latent(a, b)[0]
        assert "non-finite" in _check_latent(b, a)[0]
    assert _check_latent(np.zeros(4, np.float32), np.zeros(4, np.float32)) == []
    assert G.latent_metrics(np.zeros(4, np.float32), np.full(4, 1e-3, np.float32))["rel_l2"] == np.inf


def _pixels(n_changed, levels, shape=(4, 25, 100, 3)):
    a = np.full(shape, 100, np.uint8)
    b = a.copy().reshape(-1)
    b[:n_changed] += levels
    return a, b.reshape(shape)


def test_pixel_rmse_threshold():
    # 30 000 values; a fraction f off by 2 levels: RMSE = 2/127.5·√f, ≤ 0.01 iff f ≤ 0.4064.
    a, inside = _pixels(12_000, 2)
    _, outside = _pixels(12_300, 2)
    mi, mo = G.pixel_metrics(a, inside), G.pixel_metrics(a, outside)
    assert mi["rmse"] == pytest.approx(2 * STEP * np.sqrt(0.40))
    assert G.pixel_passes(mi) == []
    reasons = G.pixel_passes(mo)
    assert len(reasons) == 1 and reasons[0].startswith("rmse")


def test_pixel_max_abs_threshold():
    a, inside = _pixels(1, 3)  # 3 levels = 0.0235
    _, outside = _pixels(1, 4)  # 4 levels = 0.0314
    assert G.pixel_metrics(a, inside)["max_abs"] == pytest.approx(3 * STEP)
    assert G.pixel_passes(G.pixel_metrics(a, inside)) == []
    reasons = G.pixel_passes(G.pixel_metrics(a, outside))
    assert len(reasons) == 1 and reasons[0].startswith("max")


def test_pixel_mapping():
    assert G.to_unit_range(np.array([0, 255], np.uint8)).tolist() == [-1.0, 1.0]


# ---- the gate over run directories ----------------------------------------------------------


def test_exact_fails_on_one_byte_threshold_passes(tmp_path):
    a = make_run(tmp_path, "a")

    def nudge(e, c, latent, pixels):
        if (e, c) == (1, 0):
            latent.view(np.uint32)[0, 0, 0, 0] ^= 1  # one ulp
        return latent, pixels

    b = make_run(tmp_path, "b", edit=nudge)
    ex = G.gate(a, b, "exact")
    assert not ex.passed
    failed = {r.path for r in ex.files if not r.passed}
    assert failed == {"epoch1/chunk00.latent.npy", "hashes.jsonl[epoch 1 chunk 0]"}
    assert ex.verdict.startswith("fail") and "bytes differ" in ex.verdict
    assert G.gate(a, b, "threshold").passed


def test_exact_compares_hashes_of_unsaved_epochs(tmp_path):
    a = make_run(tmp_path, "a")
    b = make_run(tmp_path, "b", edit=lambda e, c, l, p: (l, p ^ np.uint8(e == 2 and c == 1)))
    ex = G.gate(a, b, "exact")
    assert [r.path for r in ex.files if not r.passed] == ["hashes.jsonl[epoch 2 chunk 1]"]
    assert G.gate(a, b, "threshold").passed


def test_threshold_gate_fails_outside_threshold(tmp_path):
    a = make_run(tmp_path, "a")

    def brighten(e, c, latent, pixels):
        if (e, c) == (0, 1):
            pixels = np.clip(pixels.astype(np.int16) + 4, 0, 255).astype(np.uint8)
        return latent, pixels

    r = G.gate(a, make_run(tmp_path, "b", edit=brighten), "threshold")
    bad = [f for f in r.files if not f.passed]
    assert [f.path for f in bad] == ["epoch0/chunk01.pixels.npy"]
    assert bad[0].metrics["max_abs"] == pytest.approx(4 * STEP)


def test_missing_and_extra_files_fail(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    G.chunk_path(b, 1, 1, "pixels").unlink()
    r = G.gate(a, b, "threshold")
    assert not r.passed
    assert any(f.path == "epoch1/chunk01.pixels.npy" and "missing in run B" in f.reasons[0] for f in r.files)
    extra = make_run(tmp_path, "c", chunks=3)
    r = G.gate(a, extra, "exact")
    paths = {f.path for f in r.files if not f.passed}
    assert "epoch0/chunk02.latent.npy" in paths and "hashes.jsonl[epoch 2 chunk 2]" in paths
    assert all("missing in run A" in f.reasons[0] for f in r.files if not f.passed)


def test_missing_in_both_runs_is_still_a_failure(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    for run in (a, b):
        G.chunk_path(run, 0, 0, "latent").unlink()
    r = G.gate(a, b, "exact")
    assert not r.passed
    assert [f.path for f in r.files if not f.passed] == ["epoch0/chunk00.latent.npy"]


def test_nan_fails_even_when_identical(tmp_path):
    def poison(e, c, latent, pixels):
        if (e, c) == (1, 1):
            latent[0, 0, 0, 0] = np.nan
        return latent, pixels

    a, b = make_run(tmp_path, "a", edit=poison), make_run(tmp_path, "b", edit=poison)
    for kind in ("exact", "threshold"):
        r = G.gate(a, b, kind)
        assert not r.passed
        assert [f.path for f in r.files if not f.passed] == ["epoch1/chunk01.latent.npy"]
    r = G.gate(make_run(tmp_path, "clean"), b, "threshold")
    assert not r.passed and "non-finite" in r.verdict


def test_empty_runs_never_pass(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for kind in ("exact", "threshold"):
        r = G.gate(tmp_path / "a", tmp_path / "b", kind)
        assert not r.passed and r.verdict.startswith("fail")


def test_missing_hashes_file_fails(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    (b / "outputs" / "hashes.jsonl").unlink()
    r = G.gate(a, b, "threshold")
    assert not r.passed and "unreadable" in r.verdict


def test_file_must_match_its_own_hash_record(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    latent, pixels = _arrays(0, 0)
    # Overwrite the saved file only (a writer bug): the records still agree across runs.
    for run in (a, b):
        G.save_chunk_outputs(run, 0, 0, latent + np.float32(1e-4), pixels)
    r = G.gate(a, b, "exact")
    assert not r.passed
    assert {f.path for f in r.files if not f.passed} == {"epoch0/chunk00.latent.npy"}
    assert any("does not match its hash record" in f.reasons[0] for f in r.files if not f.passed)


def test_shape_and_dtype_mismatch_fail(tmp_path):
    a = make_run(tmp_path, "a")
    b = make_run(tmp_path, "b", edit=lambda e, c, l, p: (l, p[:, :-1]) if (e, c) == (0, 0) else (l, p))
    r = G.gate(a, b, "threshold")
    assert not r.passed and any("shape" in x for f in r.files for x in f.reasons)
    np.save(G.chunk_path(b, 1, 0, "pixels"), np.zeros((12, 16, 24, 3), np.float32))
    r = G.gate(a, b, "threshold")
    assert any("dtype" in x for f in r.files for x in f.reasons)


def test_split_writers_and_extra_record_fields(tmp_path):
    """Latents and pixels are saved by different processes; records may carry the session."""
    a = make_run(tmp_path, "a")
    b = tmp_path / "b"
    records = []
    for e in range(3):
        for c in range(2):
            latent, pixels = _arrays(e, c)
            if e in G.SAVED_EPOCHS:
                lh = G.save_latent(b, e, c, latent)
                ph = G.save_pixels(b, e, c, pixels)
            else:
                lh, ph = G.array_sha256(latent), G.array_sha256(pixels)
            records.append(G.HashRecord(epoch=e, chunk=c, session=e, latent_sha256=lh, pixels_sha256=ph))
    G.write_hashes(b, records)
    assert G.gate(a, b, "exact").passed
    # A plain dict record with unknown keys (as a writer may emit) still reads.
    path = b / "outputs" / "hashes.jsonl"
    path.write_text(path.read_text().replace('"session":0', '"session":0,"note":"x"'))
    assert G.read_hashes(b)[0].session == 0


def test_incomplete_hash_record_fails(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    recs = G.read_hashes(b)
    recs[5] = G.HashRecord(epoch=recs[5].epoch, chunk=recs[5].chunk, latent_sha256=recs[5].latent_sha256)
    G.write_hashes(b, recs)
    for kind in ("exact", "threshold"):
        r = G.gate(a, b, kind)
        assert not r.passed and "no pixels hash" in r.verdict


def test_unknown_kind(tmp_path):
    with pytest.raises(ValueError):
        G.gate(tmp_path, tmp_path, "close-enough")


def test_runs_of_different_session_counts_compare_the_sessions_both_hold(tmp_path):
    a, b = make_run(tmp_path, "a", epochs=5), make_run(tmp_path, "b", epochs=3)
    for kind in ("exact", "threshold"):
        r = G.gate(a, b, kind)
        assert r.passed, r.verdict
        assert r.only_a == [3, 4] and r.only_b == []
        assert "compared the 3 sessions both runs hold (epochs 0–2); run A alone holds epochs 3–4, not compared" in r.verdict
        # what was compared: the saved files (epochs 0-1) and the hash records of epochs 0-2, no more
        compared = {int(m.group(1)) for f in r.files if (m := re.search(r"epoch ?(\d+)", f.path))}
        assert compared == {0, 1, 2}, sorted(f.path for f in r.files)

    def nudge(e, c, latent, pixels):
        if (e, c) == (2, 1):
            pixels[0, 0, 0, 0] ^= 1
        return latent, pixels

    r = G.gate(a, make_run(tmp_path, "c", epochs=3, edit=nudge), "exact")  # a common session still counts
    assert not r.passed and [f.path for f in r.files if not f.passed] == ["hashes.jsonl[epoch 2 chunk 1]"]
    late = tmp_path / "late"
    for c in range(2):
        G.record_chunk(late, 7, c, *_arrays(7, c))  # epoch 7 only: hashed, not saved
    r = G.gate(a, late, "exact")
    assert not r.passed and "no session (epoch) in common" in r.verdict and r.only_b == [7]
