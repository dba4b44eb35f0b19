"""Least squares for the cost model (`costs.Costs`): a fit whose coefficients stay >= 0,
over observations whose weight decays, kept as normal equations (a few floats that
``costs.json`` saves and loads)."""

from __future__ import annotations

from typing import Callable

ALPHA = 0.3  # weight of the newest observation in every fit
# A tier's restores are trusted from the second timing on (decayed weight 1 + 0.7): a
# process's first restore from a tier pays one-off costs (MLX compiling its kernels for
# the shapes met: a RAM-tier restore of 256 tokens took 7.2 ms the first time and 1.8 ms
# after on an H200), and a tier judged slower on such a timing alone is never timed
# again. Rates set by hand (`set_restore`) count as trusted.
TRUSTED_WEIGHT = 1.5
SET_WEIGHT = 2.0  # the weight `Fit.set` gives the coefficients it is told


class Fit:
    """``y ≈ Σ coef_i · x_i`` with every coefficient >= 0: least squares over observations
    whose weight decays by ``1 − ALPHA`` per newer one.

    Where the observations cannot tell the features apart (too few, all alike), the
    least important feature whose going makes the rest solvable is left out
    (coefficient 0); where a coefficient comes out negative (noise), that feature is;
    and the rest are fitted again.

    Args:
        order: The features' indexes, most important first (their count is the fit's),
            or a function of the normal equations' sums giving them (the order can
            depend on what was observed).
        sums: Saved normal equations (`sums` of an earlier fit), if any.
        keep_first: A negative coefficient of the most important feature drops the least
            important one instead (a restore's rate: see `_solve_sums`); False drops any
            negative coefficient (a prefill's).
        features: The number of features, when `order` is a function (required then).

    Raises:
        TypeError: If `order` is a function and `features` is not given.
    """

    def __init__(
        self,
        order: tuple[int, ...] | Callable[[list[float]], tuple[int, ...]],
        sums: list[float] | None = None,
        *,
        keep_first: bool = True,
        features: int | None = None,
    ):
        self._order = order
        self.keep_first = keep_first
        if not callable(order):
            k = len(order)
        elif features is None:
            raise TypeError("a Fit whose order is a function needs its number of features")
        else:
            k = features
        self.k = k
        self.sums = [float(v) for v in sums] if sums and len(sums) == k * k + k else [0.0] * (k * k + k)
        self._solved: tuple[list[float] | None] | None = None  # `coefficients` until the sums change

    def add(self, x: tuple[float, ...], y: float) -> None:
        """Add one observation: features `x`, value `y`."""
        k, keep = self.k, 1 - ALPHA
        new = [x[i] * x[j] for i in range(k) for j in range(k)] + [x[i] * y for i in range(k)]
        self.sums = [keep * s + n for s, n in zip(self.sums, new)]
        self._solved = None

    def set(self, coefficients: tuple[float, ...]) -> None:
        """Forget the observations: the coefficients are now these (as if timed
        `SET_WEIGHT` times)."""
        k = self.k
        w = SET_WEIGHT
        self.sums = [w * (i == j) for i in range(k) for j in range(k)] + [w * float(c) for c in coefficients]
        self._solved = None

    @property
    def order(self) -> tuple[int, ...]:
        """The features' indexes, most important first, for the observations so far."""
        return self._order(self.sums) if callable(self._order) else self._order

    def weight(self) -> float:
        """The decayed number of observations (feature 0 is the constant 1: restore fits)."""
        return self.sums[0]

    def coefficients(self) -> list[float] | None:
        """The coefficients, None before any observation (solved once per change of
        the sums: a fetch asks for them a dozen times)."""
        if self._solved is None:
            self._solved = (self._solve_sums(),)
        coef = self._solved[0]
        return None if coef is None else list(coef)

    def _solve_sums(self) -> list[float] | None:
        k = self.k
        m, v = self.sums[: k * k], self.sums[k * k :]
        active = [i for i in self.order if m[i * k + i] > 0]

        def solve(features: list[int]) -> list[float] | None:
            return _solve([[m[i * k + j] for j in features] for i in features], [v[i] for i in features])

        while active:
            z = solve(active)
            if z is None:
                # Features the observations cannot tell apart: leave out the least
                # important one whose going makes the rest solvable.
                fewer = [active[:j] + active[j + 1 :] for j in range(len(active) - 1, 0, -1)]
                active = next((f for f in fewer if solve(f) is not None), active[:-1])
                continue
            if min(z) < 0:
                # Noise: the most negative goes, unless it is the most important feature
                # and `keep_first` (a restore's bytes): then the least important one does.
                # Timings of one size alone cannot split a rate from a fixed cost, and a
                # fit left with the fixed cost only reads as "not timed yet", which
                # restores again at that same size, forever.
                worst = z.index(min(z))
                active.pop(len(active) - 1 if worst == 0 and len(active) > 1 and self.keep_first else worst)
                continue
            out = [0.0] * k
            for i, c in zip(active, z):
                out[i] = c
            return out
        return None


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``m z = v`` for a small symmetric positive matrix (scaled to a unit diagonal
    first: the features differ by many orders of magnitude); None if singular."""
    n = len(v)
    d = [m[i][i] ** 0.5 for i in range(n)]
    a = [[m[i][j] / (d[i] * d[j]) for j in range(n)] + [v[i] / d[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-9:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] / d[i] for i in range(n)]
