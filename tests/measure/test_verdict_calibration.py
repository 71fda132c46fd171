"""Calibration of the A/B verdict: seeded synthetic runs through the real verdict code.

Each run is a sequential comparison (``compare --until-resolved``): rounds of one baseline and
one candidate launch, each launch ``SESSIONS`` measured sessions of ``CHUNKS`` steady intervals.
Log interval = launch effect + session effect + chunk noise, with occasional 3× outliers; the
candidate is slower or faster by a true ``shift``. A verdict "faster"/"slower" is false when the
shift is 0. Everything is vectorised over trials, so the whole module runs in seconds.

Monte-Carlo margin: a rate measured over TRIALS = 1000 seeded trials has standard error
√(p(1−p)/1000), 0.6 points at p = 3.5 %; the false-verdict bound is 5 % plus two of them, the
power bound (80 %) takes no allowance. The second test is the same simulation with sessions as the
units (launch variance left out of the interval): it must break that bound.
"""

from __future__ import annotations

import math

import numpy as np

from harness.measure import stats as S

SESSIONS, CHUNKS = 3, 4
LAUNCH, SESSION, CHUNK = 0.05, 0.02, 0.03  # log-normal sigmas
OUTLIER_P, OUTLIER_X = 0.02, 3.0
TRIALS = 1000


def simulate(rng, trials, rounds, shift):
    """(trials, rounds, sessions, chunks) intervals in ms of each arm."""
    def arm(mu):
        shape = (trials, rounds, SESSIONS, CHUNKS)
        log = (mu + rng.normal(0, LAUNCH, shape[:2])[..., None, None] + rng.normal(0, SESSION, shape[:3])[..., None]
               + rng.normal(0, CHUNK, shape))
        return np.exp(log) * np.where(rng.random(shape) < OUTLIER_P, OUTLIER_X, 1.0)
    return arm(math.log(600.0)), arm(math.log(600.0) + math.log1p(shift))


def sequential(a, b, max_rounds, level="launch", margin=S.DEFAULT_MARGIN):
    """Outcome code of every trial (``stats.decide``'s codes) and the rounds it took."""
    looks = S.sequential_looks(max_rounds)
    levels = S.spending_levels(looks)
    ua, ub = S.units(a, level), S.units(b, level)
    per = ua.shape[-1] // a.shape[1]  # units per launch
    code = np.zeros(a.shape[0], dtype=int)
    took = np.full(a.shape[0], max_rounds)
    for r, lv in zip(looks, levels):
        c, _, _ = S.decide(*S.log_ratio(ua[:, : r * per], ub[:, : r * per]), lv, margin)
        new = (code == 0) & (c != 0)
        code[new], took[new] = c[new], r
    return code, took


def rate(mask):
    p = float(np.mean(mask))
    return p, math.sqrt(max(p * (1 - p), 1e-4) / mask.size)


def test_false_verdicts_at_most_five_percent_and_power_at_a_five_percent_shift():
    rng = np.random.default_rng(20261201)
    a, b = simulate(rng, TRIALS, S.DEFAULT_MAX_ROUNDS, 0.0)
    code, _ = sequential(a, b, S.DEFAULT_MAX_ROUNDS)
    false, se = rate((code == 1) | (code == 2))
    assert false <= 0.05 + 2 * se, (false, se)
    a, b = simulate(rng, TRIALS, S.DEFAULT_MAX_ROUNDS, 0.05)
    code, took = sequential(a, b, S.DEFAULT_MAX_ROUNDS)
    power, _ = rate(code == 2)
    assert power >= 0.80, power
    assert np.mean(code == 1) < 0.01  # never the wrong direction, near enough


def test_without_launch_variance_the_interval_gives_false_verdicts():
    # Same simulation, sessions as the units (what the session bootstrap did): too narrow.
    rng = np.random.default_rng(20261201)
    a, b = simulate(rng, TRIALS, S.DEFAULT_MAX_ROUNDS, 0.0)
    code, _ = sequential(a, b, S.DEFAULT_MAX_ROUNDS, level="session")
    false, se = rate((code == 1) | (code == 2))
    assert false > 0.05 + 2 * se, (false, se)
