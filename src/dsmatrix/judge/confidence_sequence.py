"""An anytime-valid confidence sequence for a mean: the t confidence sequence of

    M. Lindon, D. W. Ham, M. Tingley, I. Bojinov (2024). "Anytime-Valid Linear Models and
    Regression Adjusted Causal Inference in Randomized Experiments", arXiv:2210.08589,

for the intercept-only linear model y_i = mu + e_i with Gaussian errors of unknown variance and
prior scale phi = 1. After n observations (nu = n - 2 degrees of freedom, z2 = the precision of
the estimate in units of the error variance, r = phi / (phi + z2)) the radius around the estimate
is ``stderr * sqrt(nu * (1 - q) / (q - r))`` with ``q = (r * alpha**2) ** (1 / (nu + 1))``; the
sequence is the running intersection of these intervals, so its coverage holds however often it is
looked at. The estimate and its precision are those of recursive least squares started from a
covariance of 1e6 (a ridge prior of precision 1e-6), as savvi 0.3.1's ``LinearRegression`` computes
them; ``tests/quick/test_throughput_rules.py`` holds this to savvi's figures on recorded rounds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PRIOR_PRECISION = 1e-6  # recursive least squares from covariance 1e6
PHI = 1.0  # prior scale


def mean_confidence_sequence(values: Sequence[float], alpha: float) -> tuple[float, float]:
    """The anytime-valid (1 - alpha) interval for the mean after all of ``values``, intersected
    over every prefix; (-inf, inf) until there are three values."""
    y = np.asarray(values, dtype=float)
    n = np.arange(1, y.size + 1, dtype=float)
    precision = n + PRIOR_PRECISION
    estimate = np.cumsum(y) / precision
    sse = np.cumsum(y * y) - estimate * np.cumsum(y)
    nu = n - 2
    with np.errstate(divide="ignore", invalid="ignore"):
        variance = np.where((nu > 0) & (sse > 0), sse / (n - 1), np.nan)  # no spread yet: no interval
        stderr = np.sqrt(variance / precision)
        r = PHI / (PHI + precision)
        q = (r * alpha**2) ** (1 / (nu + 1))
        radius = stderr * np.sqrt(nu * (1 - q) / np.maximum(0.0, q - r))
    low = np.fmax.accumulate(np.concatenate(([-np.inf], estimate - radius)))[-1]  # fmax/fmin skip NaN
    high = np.fmin.accumulate(np.concatenate(([np.inf], estimate + radius)))[-1]
    return float(low), float(high)
