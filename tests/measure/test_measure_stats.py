import numpy as np
import pytest

from harness.measure import stats as S


def test_nearest_rank_known_values():
    v = [35, 20, 15, 50, 40]  # the classic example, unsorted
    assert [S.nearest_rank(v, p) for p in (0, 5, 30, 40, 50, 100)] == [15, 15, 20, 20, 35, 50]
    r = list(range(1, 101))
    assert S.nearest_rank(r, 50) == 50 and S.nearest_rank(r, 99) == 99 and S.nearest_rank(r, 100) == 100
    # Exact rank arithmetic: 0.95 * 20 is 19, not 19.000000000000004 rounded up to 20.
    assert S.nearest_rank(list(range(1, 21)), 95) == 19
    assert S.nearest_rank([7.5], 99) == 7.5
    with pytest.raises(ValueError):
        S.nearest_rank([], 50)
    with pytest.raises(ValueError):
        S.nearest_rank([1], 101)


def test_reported_percentile_occurred():
    rng = np.random.default_rng(1)
    v = rng.normal(size=37)
    for p in (1, 10, 50, 90, 99):
        assert S.nearest_rank(v, p) in v


def test_p99_flag_below_100_samples():
    assert S.min_samples(99) == 100 and S.min_samples(95) == 20 and S.min_samples(50) == 2
    small = S.percentile(range(1, 100), 99)
    assert small.value == 99 and small.flagged and small.n == 99  # the maximum, flagged
    full = S.percentile(range(1, 101), 99)
    assert full.value == 99 and not full.flagged
    assert S.percentile(range(1, 20), 95).flagged and not S.percentile(range(1, 21), 95).flagged


def test_rowwise_matches_scalar_on_padded_rows():
    rng = np.random.default_rng(2)
    rows = rng.normal(size=(50, 30))
    lengths = rng.integers(1, 31, size=50)
    for i, n in enumerate(lengths):
        rows[i, n:] = np.nan
    for p in (0, 1, 33.3, 50, 95, 99, 100):
        got = S.p_stat(p)(rows)
        want = [S.nearest_rank(rows[i, :n], p) for i, n in enumerate(lengths)]
        assert got.tolist() == want


def test_bootstrap_is_reproducible():
    rng = np.random.default_rng(3)
    sessions = [rng.normal(100, 5, size=4) for _ in range(20)]
    a = S.bootstrap_percentile(sessions, 50, n_boot=500, seed=7)
    b = S.bootstrap_percentile(sessions, 50, n_boot=500, seed=7)
    c = S.bootstrap_percentile(sessions, 50, n_boot=500, seed=8)
    assert a == b and (a.low, a.high) != (c.low, c.high)
    assert a.low <= a.value <= a.high
    assert a.value == S.nearest_rank(np.concatenate(sessions), 50)
    assert (a.n_sessions, a.n_samples, a.method) == (20, 80, "session")


def test_bootstrap_keeps_sessions_whole():
    # Session k holds values 10k .. 10k+(k%3): a replicate is a union of whole sessions.
    sessions = [[10 * k + j for j in range(k % 3 + 1)] for k in range(12)]

    def check(sample):
        ids, counts = np.unique(sample // 10, return_counts=True)
        for k in ids.astype(int):
            members = sample[sample // 10 == k]
            n = k % 3 + 1
            assert len(members) % n == 0
            assert np.array_equal(np.sort(members), np.repeat(np.arange(10 * k, 10 * k + n), len(members) // n))
        return 0.0

    S.bootstrap_sessions(sessions, S.rowwise(check), n_boot=200, seed=0)


def test_circular_blocks_are_consecutive_sessions():
    idx = S.session_indices(10, 100, np.random.default_rng(0), block_length=3)
    assert idx.shape == (100, 10)
    for row in idx:
        for b in range(0, 10, 3):
            block = row[b : b + 3]
            assert np.array_equal(block, (block[0] + np.arange(len(block))) % 10)
    e = S.bootstrap_percentile([[1.0], [2.0], [3.0], [4.0]], 50, n_boot=100, block_length=2)
    assert e.method == "circular-block:2"


def test_bootstrap_input_errors():
    with pytest.raises(ValueError):
        S.bootstrap_percentile([], 50)
    with pytest.raises(ValueError):
        S.bootstrap_percentile([[], []], 50)
    with pytest.raises(ValueError):
        S.bootstrap_percentile([[1.0, float("nan")]], 50)
    one = S.bootstrap_percentile([[3.0, 1.0, 2.0]], 50, n_boot=50)
    assert one.low == one.value == one.high == 2.0  # one session: the interval collapses


def _coverage(n_trials, n_sessions, per_session, sigma_session, sigma_noise, seed, as_sessions):
    rng = np.random.default_rng(seed)
    true_median = 100.0  # offsets and noise are symmetric around it
    covered = 0
    for t in range(n_trials):
        offsets = rng.normal(0, sigma_session, size=(n_sessions, 1))
        data = true_median + offsets + rng.normal(0, sigma_noise, size=(n_sessions, per_session))
        sessions = list(data) if as_sessions else [[x] for x in data.ravel()]
        e = S.bootstrap_percentile(sessions, 50, n_boot=400, seed=t)
        covered += e.contains(true_median)
    return covered / n_trials


def test_session_bootstrap_covers_true_median_with_correlated_sessions():
    cov = _coverage(200, 30, 4, sigma_session=1.0, sigma_noise=1.0, seed=11, as_sessions=True)
    assert cov >= 0.90, cov
    # Why sessions stay together: treating the same correlated intervals as independent gives
    # intervals too narrow to cover.
    naive = _coverage(200, 30, 4, sigma_session=1.0, sigma_noise=1.0, seed=11, as_sessions=False)
    assert naive < cov and naive < 0.90, (naive, cov)


def test_ratio_of_medians():
    rng = np.random.default_rng(5)
    base = [rng.normal(100, 2, size=4) for _ in range(10)]
    cand = [rng.normal(80, 2, size=4) for _ in range(10)]
    e = S.ratio_of_medians(base, cand, n_boot=500, seed=1)
    med = lambda s: S.nearest_rank(np.concatenate(s), 50)
    assert e.value == med(cand) / med(base)
    assert e.low < 0.8 < e.high and e.high < 0.9
    assert e.n_sessions == 20 and e.n_samples == 80
    assert e == S.ratio_of_medians(base, cand, n_boot=500, seed=1)


def _est(value, low, high):
    return S.Estimate(value, low, high, 0.95, 1000, 0, 10, 40, "session")


def test_verdict_logic():
    aa = _est(1.0, 0.98, 1.03)  # noise floor 0.03
    assert S.noise_floor(aa) == pytest.approx(0.03)
    assert S.ab_verdict(_est(0.9, 0.88, 0.92), aa, True).verdict == "faster"
    assert S.ab_verdict(_est(1.1, 1.08, 1.12), aa, True).verdict == "slower"
    # Clears 1 but not the noise band.
    assert S.ab_verdict(_est(0.98, 0.975, 0.985), aa, True).verdict == "no resolvable difference"
    assert S.ab_verdict(_est(1.0, 0.95, 1.05), aa, True).verdict == "no resolvable difference"
    # Without an A/A estimate the floor is 0, and the reason says so.
    v = S.ab_verdict(_est(0.98, 0.975, 0.985), None, True)
    assert v.verdict == "faster" and "no A/A noise floor" in v.reason
    # No verdict unless the gate passed.
    for g in (False, None):
        v = S.ab_verdict(_est(0.5, 0.4, 0.6), aa, g)
        assert v.verdict == "no verdict" and "gate" in v.reason
    drift = S.ab_verdict(_est(0.5, 0.4, 0.6), _est(1.05, 1.02, 1.08), True)
    assert drift.verdict == "faster" and "excludes 1" in drift.reason


def test_compare_ab_end_to_end():
    rng = np.random.default_rng(6)
    make = lambda mu: [mu + rng.normal(0, 1) + rng.normal(0, 1, size=4) for _ in range(12)]
    base, fast, same = make(100), make(85), make(100)
    assert S.compare_ab(base, fast, gate_passed=True, n_boot=500).verdict == "faster"
    assert S.compare_ab(fast, base, gate_passed=True, n_boot=500).verdict == "slower"
    v = S.compare_ab(base, same, gate_passed=True, n_boot=500)
    assert v.verdict == "no resolvable difference" and v.aa is not None
    assert S.compare_ab(base, fast, gate_passed=False, n_boot=500).verdict == "no verdict"
    assert S.split_alternating([1, 2, 3, 4, 5]) == ([1, 3, 5], [2, 4])


def test_interval_ranks_are_exact():
    # (1 − 0.95) / 2 · 100 is 2.500000000000002 in floats: rank 51 of 2000 instead of 50.
    ordinal = lambda rows: np.arange(rows.shape[0], dtype=np.float64)  # replicate r has value r
    e = S.bootstrap_sessions([[1.0], [2.0]], ordinal, n_boot=2000)
    assert (e.low, e.high) == (49.0, 1949.0)  # ranks 50 and 1950: the 2.5th and 97.5th percentiles
    e = S.bootstrap_sessions([[1.0], [2.0]], ordinal, n_boot=2000, confidence=0.9)
    assert (e.low, e.high) == (99.0, 1899.0)


def test_compare_ab_gives_no_verdict_without_two_sessions_per_half():
    # 3 baseline sessions split into halves of 2 and 1: no A/A floor, and a one-session half
    # bootstraps to a zero-width interval. Clearly faster data must still get no verdict.
    base = [[100.0, 101.0, 99.0]] * 3
    cand = [[50.0, 51.0, 49.0]] * 3
    v = S.compare_ab(base, cand, gate_passed=True, n_boot=200)
    assert v.verdict == "no verdict" and "A/A" in v.reason and v.aa is None
    assert S.compare_ab(base + base[:1], cand, gate_passed=True, n_boot=200).verdict == "faster"


def test_noise_floor_is_the_far_end_of_an_asymmetric_aa():
    assert S.noise_floor(_est(1.0, 0.99, 1.04)) == pytest.approx(0.04)
    assert S.noise_floor(_est(1.0, 0.96, 1.01)) == pytest.approx(0.04)
    # The near end (0.01) would let this interval clear the band; the far end (0.04) does not.
    for aa in (_est(1.0, 0.99, 1.04), _est(1.0, 0.96, 1.01)):
        assert S.ab_verdict(_est(0.96, 0.95, 0.97), aa, True).verdict == "no resolvable difference"
        assert S.ab_verdict(_est(1.04, 1.03, 1.05), aa, True).verdict == "no resolvable difference"
        assert S.ab_verdict(_est(0.94, 0.93, 0.955), aa, True).verdict == "faster"


def test_verdict_needs_the_whole_interval_not_the_point():
    aa = _est(1.0, 0.98, 1.02)
    assert S.ab_verdict(_est(0.90, 0.85, 1.01), aa, True).verdict == "no resolvable difference"
    assert S.ab_verdict(_est(1.10, 0.99, 1.20), aa, True).verdict == "no resolvable difference"
    assert S.ab_verdict(_est(0.90, 0.85, 0.985), aa, True).verdict == "no resolvable difference"  # high inside band


def test_verdict_boundaries_are_strict():
    aa = _est(1.0, 0.75, 1.25)  # floor 0.25: every value below is exact in binary
    assert S.noise_floor(aa) == 0.25
    assert S.ab_verdict(_est(0.6, 0.5, 0.75), aa, True).verdict == "no resolvable difference"
    assert S.ab_verdict(_est(0.6, 0.5, np.nextafter(0.75, 0)), aa, True).verdict == "faster"
    assert S.ab_verdict(_est(1.4, 1.25, 1.5), aa, True).verdict == "no resolvable difference"
    assert S.ab_verdict(_est(1.4, np.nextafter(1.25, 2), 1.5), aa, True).verdict == "slower"
