"""Saved outputs and the numeric gates over them (DESIGN §5).

Layout of a run directory (the writer and the gate both use the helpers here, so they agree):

- ``outputs/epoch{E}/chunk{CC}.latent.npy``: float32 latent of chunk CC (two digits) of epoch E.
- ``outputs/epoch{E}/chunk{CC}.pixels.npy``: uint8 pixels, (T, H, W, 3) RGB.
- ``outputs/hashes.jsonl``: one ``HashRecord`` per chunk of *every* epoch, saved or not. A hash is
  the SHA-256 of the array's raw C-order bytes (``array_sha256``): latents and pixels are produced
  in different processes (driver, encoder), which hash what they hold without building a file.

Gates, with run A the reference:

- ``exact``: every saved file byte-identical and every hash record equal.
- ``threshold``: latent ‖b−a‖₂/‖a‖₂ ≤ 0.01 and |b−a| ≤ 0.03 + 0.03·|a| everywhere; pixels mapped to
  [−1, 1] by x/127.5 − 1: RMSE ≤ 0.01 and max|Δ| ≤ 0.03 (one uint8 step is 0.0078, so up to
  3 steps per pixel pass). Hash records must cover the same chunks; their values are not compared.

Both: a file or record present on one side only fails, an unreadable file fails, a non-finite value
(NaN/Inf) anywhere fails, and comparing nothing fails — a gate never passes by skipping.

Runs that hold pixels only (a client's run of ``client --api vllm-omni``: it decodes frames and has
no latents) are compared on pixels when *both* runs hold no latent at all (no latent file, no latent
hash); the verdict says so. One such run against a run with latents fails on the missing latents.

Runs of different session counts (``--sessions 3`` against ``--sessions 6``) are compared on the
sessions (epochs) both hold; the verdict names the epochs only one run has, which are not compared.
Within a common epoch every chunk must be on both sides.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import re
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from harness.limits import MAX_JSON_BYTES, read_bounded

OUTPUTS_DIR = "outputs"
HASHES_FILE = "hashes.jsonl"
SAVED_EPOCHS: tuple[int, ...] = (0, 1)

GateKind = Literal["exact", "threshold"]
_FILE_RE = re.compile(r"^epoch(\d+)/chunk(\d+)\.(latent|pixels)\.npy$")


class Thresholds(msgspec.Struct, frozen=True, kw_only=True):
    latent_rel_l2: float = 0.01
    latent_atol: float = 0.03
    latent_rtol: float = 0.03
    pixel_rmse: float = 0.01
    pixel_max_abs: float = 0.03


DEFAULT_THRESHOLDS = Thresholds()


# ---- writing -------------------------------------------------------------------------------


class HashRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Hashes of one chunk; ``None`` where that output was never produced (the gate fails it)."""

    epoch: int
    chunk: int
    session: int | None = None
    latent_sha256: str | None = None
    pixels_sha256: str | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.epoch, self.chunk)


def chunk_path(run_dir: str | Path, epoch: int, chunk: int, what: Literal["latent", "pixels"]) -> Path:
    return Path(run_dir) / OUTPUTS_DIR / f"epoch{epoch}" / f"chunk{chunk:02d}.{what}.npy"


def _check_latent(latent: np.ndarray) -> None:
    if latent.dtype != np.float32:
        raise ValueError(f"latent must be float32, got {latent.dtype}")


def _check_pixels(pixels: np.ndarray) -> None:
    if pixels.dtype != np.uint8 or pixels.ndim != 4 or pixels.shape[-1] != 3:
        raise ValueError(f"pixels must be uint8 (T, H, W, 3), got {pixels.dtype} {pixels.shape}")


def npy_bytes(array: np.ndarray) -> bytes:
    """The bytes of a ``.npy`` file (format 1.0, no pickle), written whole so a reader never sees half."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), version=(1, 0), allow_pickle=False)
    return buf.getvalue()


def array_sha256(array: np.ndarray) -> str:
    """The hash of ``hashes.jsonl``: SHA-256 of the raw C-order bytes (dtype and shape are fixed by
    the config, and the saved files carry them)."""
    return hashlib.sha256(np.ascontiguousarray(array).data).hexdigest()


def hash_record(epoch: int, chunk: int, latent: np.ndarray, pixels: np.ndarray, session: int | None = None) -> HashRecord:
    _check_latent(latent)
    _check_pixels(pixels)
    return HashRecord(epoch=epoch, chunk=chunk, session=session, latent_sha256=array_sha256(latent), pixels_sha256=array_sha256(pixels))


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)  # a crash leaves the old file or none, never a truncated .npy
    except BaseException:  # a full disk: no truncated .tmp left beside the finished chunks
        tmp.unlink(missing_ok=True)
        raise


def save_latent(run_dir: str | Path, epoch: int, chunk: int, latent: np.ndarray) -> str:
    """Write ``chunk{CC}.latent.npy``; return its ``array_sha256``."""
    _check_latent(latent)
    _write_atomic(chunk_path(run_dir, epoch, chunk, "latent"), npy_bytes(latent))
    return array_sha256(latent)


def save_pixels(run_dir: str | Path, epoch: int, chunk: int, pixels: np.ndarray) -> str:
    """Write ``chunk{CC}.pixels.npy``; return its ``array_sha256``."""
    _check_pixels(pixels)
    _write_atomic(chunk_path(run_dir, epoch, chunk, "pixels"), npy_bytes(pixels))
    return array_sha256(pixels)


def save_chunk_outputs(
    run_dir: str | Path, epoch: int, chunk: int, latent: np.ndarray, pixels: np.ndarray, session: int | None = None
) -> HashRecord:
    """Write the chunk's latent and pixels; return their hash record (not appended: see ``record_chunk``)."""
    _check_latent(latent)
    _check_pixels(pixels)
    return HashRecord(
        epoch=epoch, chunk=chunk, session=session,
        latent_sha256=save_latent(run_dir, epoch, chunk, latent), pixels_sha256=save_pixels(run_dir, epoch, chunk, pixels),
    )


def append_hash_record(run_dir: str | Path, record: HashRecord) -> None:
    path = Path(run_dir) / OUTPUTS_DIR / HASHES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(msgspec.json.encode(record) + b"\n")


def record_chunk(
    run_dir: str | Path, epoch: int, chunk: int, latent: np.ndarray, pixels: np.ndarray,
    save_epochs: tuple[int, ...] = SAVED_EPOCHS, session: int | None = None,
) -> HashRecord:
    """For a writer that holds both arrays: save them if the epoch is saved, always append the hash."""
    if epoch in save_epochs:
        rec = save_chunk_outputs(run_dir, epoch, chunk, latent, pixels, session)
    else:
        rec = hash_record(epoch, chunk, latent, pixels, session)
    append_hash_record(run_dir, rec)
    return rec


def write_hashes(run_dir: str | Path, records: list[HashRecord]) -> None:
    path = Path(run_dir) / OUTPUTS_DIR / HASHES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, b"".join(msgspec.json.encode(r) + b"\n" for r in records))


def read_hashes(run_dir: str | Path) -> list[HashRecord]:
    path = Path(run_dir) / OUTPUTS_DIR / HASHES_FILE
    dec = msgspec.json.Decoder(HashRecord)
    return [dec.decode(line) for line in read_bounded(path, MAX_JSON_BYTES, "hashes file").splitlines() if line.strip()]


def list_outputs(run_dir: str | Path) -> list[str]:
    """Saved chunk files, relative to ``outputs/`` (``epoch1/chunk03.latent.npy``), sorted."""
    root = Path(run_dir) / OUTPUTS_DIR
    if not root.is_dir():
        return []
    return sorted(
        rel for p in root.glob("epoch*/chunk*.npy") if p.is_file() and _FILE_RE.match(rel := p.relative_to(root).as_posix())
    )


# ---- metrics over arrays -------------------------------------------------------------------


def _nonfinite(a: np.ndarray) -> int:
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def latent_metrics(a: np.ndarray, b: np.ndarray, t: Thresholds = DEFAULT_THRESHOLDS) -> dict[str, float]:
    """Reference ``a`` vs ``b``. ``allclose_excess`` is max(|b−a| − (atol + rtol·|a|)): ≤ 0 passes."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"shape {b64.shape} differs from reference {a64.shape}")
    nonfinite = _nonfinite(a64) + _nonfinite(b64)
    if nonfinite:
        return {"nonfinite": float(nonfinite)}
    d = np.abs(b64 - a64)
    na, nd = float(np.linalg.norm(a64)), float(np.linalg.norm(d))
    rel = nd / na if na > 0 else (0.0 if nd == 0 else math.inf)
    excess = float(np.max(d - (t.latent_atol + t.latent_rtol * np.abs(a64)))) if d.size else 0.0
    return {"rel_l2": rel, "max_abs": float(d.max()) if d.size else 0.0, "allclose_excess": excess, "nonfinite": 0.0}


def latent_passes(m: dict[str, float], t: Thresholds = DEFAULT_THRESHOLDS) -> list[str]:
    """Failed criteria, as readable reasons (empty = pass)."""
    if m["nonfinite"]:
        return [f"{int(m['nonfinite'])} non-finite values"]
    out = []
    if not m["rel_l2"] <= t.latent_rel_l2:
        out.append(f"rel_l2 {m['rel_l2']:.4g} > {t.latent_rel_l2}")
    if not m["allclose_excess"] <= 0:
        out.append(f"not allclose(atol={t.latent_atol}, rtol={t.latent_rtol}): worst excess {m['allclose_excess']:.4g}")
    return out


def to_unit_range(pixels: np.ndarray) -> np.ndarray:
    return np.asarray(pixels, np.float64) / 127.5 - 1.0


def pixel_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """RMSE and max|Δ| of uint8 pixels mapped to [−1, 1]."""
    return frame_metrics(to_unit_range(a), to_unit_range(b))


def psnr_db(rmse: float, peak_to_peak: float = 2.0) -> float | None:
    """PSNR of frames on the [−1, 1] scale, 20·log10(range / RMSE); None for identical frames.
    The pixel gate's RMSE ≤ 0.01 is PSNR ≥ 46.0 dB on this scale."""
    return None if rmse == 0 else 20.0 * math.log10(peak_to_peak / rmse)


def frame_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """RMSE and max|Δ| of frames already on the [−1, 1] scale (float, or uint8 mapped there)."""
    if a.shape != b.shape:
        raise ValueError(f"shape {b.shape} differs from reference {a.shape}")
    fa, fb = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nonfinite = _nonfinite(fa) + _nonfinite(fb)  # uint8 never is; a float input might be
    if nonfinite:
        return {"nonfinite": float(nonfinite)}
    d = fb - fa
    return {
        "rmse": float(np.sqrt(np.mean(d * d))) if d.size else 0.0,
        "max_abs": float(np.abs(d).max()) if d.size else 0.0,
        "nonfinite": 0.0,
    }


def pixel_passes(m: dict[str, float], t: Thresholds = DEFAULT_THRESHOLDS) -> list[str]:
    if m["nonfinite"]:
        return [f"{int(m['nonfinite'])} non-finite values"]
    out = []
    if not m["rmse"] <= t.pixel_rmse:
        out.append(f"rmse {m['rmse']:.4g} > {t.pixel_rmse}")
    if not m["max_abs"] <= t.pixel_max_abs:
        out.append(f"max|Δ| {m['max_abs']:.4g} > {t.pixel_max_abs}")
    return out


# ---- the gate ------------------------------------------------------------------------------


class FileResult(msgspec.Struct, frozen=True):
    path: str  # relative to outputs/, or "hashes.jsonl[epoch E chunk C]"
    passed: bool
    metrics: dict[str, float] = {}
    reasons: list[str] = []


class GateResult(msgspec.Struct, frozen=True):
    kind: str
    run_a: str
    run_b: str
    passed: bool
    #: One line: "pass: …" or "fail: …" with the first failures.
    verdict: str
    files: list[FileResult]
    n_compared: int
    n_failed: int
    thresholds: Thresholds | None = None
    #: Epochs only one run holds (different session counts): set aside, not compared.
    only_a: list[int] = []
    only_b: list[int] = []


def _epoch_of(rel: str) -> int:
    return int(_FILE_RE.match(rel).group(1))


def _spans(epochs: list[int]) -> str:
    return f"{epochs[0]}–{epochs[-1]}" if epochs == list(range(epochs[0], epochs[-1] + 1)) and len(epochs) > 1 \
        else ", ".join(map(str, epochs))


def common_epochs(fa: set[str], fb: set[str], ha: dict, hb: dict) -> tuple[set[int], list[int], list[int]]:
    """(epochs both runs hold, epochs only A holds, only B): an epoch is held when its hash records
    or saved files exist."""
    ea = {e for e, _ in ha} | {_epoch_of(f) for f in fa}
    eb = {e for e, _ in hb} | {_epoch_of(f) for f in fb}
    return ea & eb, sorted(ea - eb), sorted(eb - ea)


def _load(path: Path) -> np.ndarray:
    return np.load(path, allow_pickle=False)


def _compare_file(rel: str, pa: Path, pb: Path, kind: GateKind, t: Thresholds) -> FileResult:
    what = _FILE_RE.match(rel).group(3)
    try:
        ba, bb = pa.read_bytes(), pb.read_bytes()
        a, b = _load(pa), _load(pb)
    except (OSError, ValueError) as e:
        return FileResult(rel, False, reasons=[f"unreadable: {e}"])
    want = np.float32 if what == "latent" else np.uint8
    bad_type = [f"{side} dtype {x.dtype}, expected {np.dtype(want)}" for side, x in (("A", a), ("B", b)) if x.dtype != want]
    if bad_type:
        return FileResult(rel, False, reasons=bad_type)
    if a.shape != b.shape:
        return FileResult(rel, False, reasons=[f"shape {b.shape} differs from reference {a.shape}"])
    m = latent_metrics(a, b, t) if what == "latent" else pixel_metrics(a, b)
    reasons = latent_passes(m, t) if what == "latent" else pixel_passes(m, t)
    if kind == "exact":
        # Byte identity alone would let a NaN pass when both sides have it; the metrics above
        # fail that case.
        if ba != bb:
            reasons.insert(0, "bytes differ")
        elif m["nonfinite"] == 0:
            reasons = []
    return FileResult(rel, not reasons, m, reasons)


def _hash_table(run: Path, side: str) -> tuple[dict[tuple[int, int], HashRecord], list[FileResult]]:
    try:
        records = read_hashes(run)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        return {}, [FileResult(HASHES_FILE, False, reasons=[f"run {side}: unreadable: {e}"])]
    by_key: dict[tuple[int, int], HashRecord] = {}
    faults = []
    for r in records:
        if r.key in by_key and by_key[r.key] != r:
            faults.append(FileResult(f"{HASHES_FILE}[epoch {r.epoch} chunk {r.chunk}]", False, reasons=[f"run {side}: conflicting records"]))
        by_key[r.key] = r
    return by_key, faults


def pixels_only(files: set[str], records: dict) -> bool:
    """A run with hash records and not one latent (file or hash): a client's decoded pixels."""
    return bool(records) and not any(".latent." in f for f in files) and all(r.latent_sha256 is None for r in records.values())


def _compare_hashes(a: dict, b: dict, kind: GateKind, outputs: tuple[str, ...] = ("latent", "pixels")) -> list[FileResult]:
    if not a and not b:
        return [FileResult(HASHES_FILE, False, reasons=["no hash records in either run"])]
    out = []
    for key in sorted(a.keys() | b.keys()):
        name = f"{HASHES_FILE}[epoch {key[0]} chunk {key[1]}]"
        if key not in a or key not in b:
            out.append(FileResult(name, False, reasons=[f"missing in run {'A' if key not in a else 'B'}"]))
        elif incomplete := [f"run {side}: no {w} hash" for side, r in (("A", a[key]), ("B", b[key]))
                            for w in outputs if getattr(r, f"{w}_sha256") is None]:
            out.append(FileResult(name, False, reasons=incomplete))
        elif kind == "exact" and (a[key].latent_sha256, a[key].pixels_sha256) != (b[key].latent_sha256, b[key].pixels_sha256):
            out.append(FileResult(name, False, reasons=["hash differs"]))
        else:
            out.append(FileResult(name, True))
    return out


def _files_match_records(run: Path, side: str, files: set[str], records: dict) -> list[FileResult]:
    """A saved file must hash to its own run's record: otherwise the exact comparison of unsaved
    epochs (by hash only) would be comparing something other than what was saved."""
    out = []
    for rel in sorted(files):
        epoch, chunk, what = _FILE_RE.match(rel).groups()
        rec = records.get((int(epoch), int(chunk)))
        if rec is None:
            continue  # reported as a missing record by the cross-run comparison or below
        try:
            digest = array_sha256(_load(run / OUTPUTS_DIR / rel))
        except (OSError, ValueError):
            continue  # reported by the file comparison
        if digest != getattr(rec, f"{what}_sha256"):
            out.append(FileResult(rel, False, reasons=[f"run {side}: file does not match its hash record"]))
    return out


def gate(run_a: str | Path, run_b: str | Path, kind: GateKind = "threshold", thresholds: Thresholds = DEFAULT_THRESHOLDS) -> GateResult:
    """Compare run B against reference run A, file by file (see the module docstring)."""
    if kind not in ("exact", "threshold"):
        raise ValueError(f"unknown gate kind {kind!r}")
    run_a, run_b = Path(run_a), Path(run_b)
    fa, fb = set(list_outputs(run_a)), set(list_outputs(run_b))
    ha, fault_a = _hash_table(run_a, "A")
    hb, fault_b = _hash_table(run_b, "B")
    common, only_a, only_b = common_epochs(fa, fb, ha, hb)
    if only_a or only_b:  # different session counts: the sessions both ran are compared, the rest named
        fa, fb = {f for f in fa if _epoch_of(f) in common}, {f for f in fb if _epoch_of(f) in common}
        ha, hb = {k: v for k, v in ha.items() if k[0] in common}, {k: v for k, v in hb.items() if k[0] in common}
    no_latents = pixels_only(fa, ha) and pixels_only(fb, hb)
    results: list[FileResult] = []
    for rel in sorted(fa | fb):
        if rel not in fa or rel not in fb:
            results.append(FileResult(rel, False, reasons=[f"missing in run {'A' if rel not in fa else 'B'}"]))
        else:
            results.append(_compare_file(rel, run_a / OUTPUTS_DIR / rel, run_b / OUTPUTS_DIR / rel, kind, thresholds))
    # A chunk saved without its partner is a broken writer even when both runs share the fault.
    for rel in sorted(fa | fb):
        partner = rel.replace(".latent.", ".pixels.") if ".latent." in rel else rel.replace(".pixels.", ".latent.")
        if no_latents:
            continue
        if partner not in fa and partner not in fb:
            results.append(FileResult(partner, False, reasons=["missing in both runs (its partner exists)"]))
    if not fa and not fb:
        results.append(FileResult(OUTPUTS_DIR, False, reasons=["no saved outputs in either run" if not (only_a or only_b)
                                                               else "no session (epoch) in common"]))
    results += fault_a + fault_b
    if not (fault_a and not ha) and not (fault_b and not hb):
        results.extend(_compare_hashes(ha, hb, kind, ("pixels",) if no_latents else ("latent", "pixels")))
    for run, side, files, table in ((run_a, "A", fa, ha), (run_b, "B", fb, hb)):
        results.extend(_files_match_records(run, side, files, table))
        missing = sorted({(int(m.group(1)), int(m.group(2))) for f in files if (m := _FILE_RE.match(f))} - table.keys())
        if table and missing:
            results.append(FileResult(HASHES_FILE, False, reasons=[f"run {side}: saved chunks without a record: {missing}"]))

    failed = [r for r in results if not r.passed]
    n_files = len(fa | fb)
    if failed:
        head = "; ".join(f"{r.path}: {', '.join(r.reasons)}" for r in failed[:3])
        more = f" (+{len(failed) - 3} more)" if len(failed) > 3 else ""
        verdict = f"fail: {len(failed)} of {len(results)} checks — {head}{more}"
    else:
        verdict = f"pass: {n_files} files and {len(results) - n_files} hash records {'identical' if kind == 'exact' else 'within threshold'}"
    if no_latents:
        verdict += " — pixels only (neither run holds latents)"
    if only_a or only_b:
        held = "; ".join(f"run {side} alone holds epochs {_spans(e)}" for side, e in (("A", only_a), ("B", only_b)) if e)
        verdict += f" — compared the {len(common)} sessions both runs hold (epochs {_spans(sorted(common))}); {held}, not compared" \
            if common else f" — {held}"
    return GateResult(
        kind, os.fspath(run_a), os.fspath(run_b), not failed, verdict, results, len(results), len(failed),
        thresholds if kind == "threshold" else None, only_a, only_b,
    )
