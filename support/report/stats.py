"""Statistics for held-out accuracies: a 95% interval for one accuracy, an interval for
the change between two evaluations, and the exact McNemar test of that change.

The before and after evaluations score the same n items, so the change is a paired
comparison: only the items that flipped say anything about it (an item right on both
sides, or wrong on both, adds nothing). Everything here is arithmetic on counts: it
reads no run and writes no HTML.
"""

import math

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: two-sided 95% intervals


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion p = k/n:

        centre = (p + z^2 / 2n) / (1 + z^2 / n)
        half   = z sqrt(p (1 - p) / n + z^2 / 4n^2) / (1 + z^2 / n)
        [centre - half, centre + half], clipped to [0, 1]; [0, 1] when n = 0.

    Unlike p ± z·sqrt(p(1-p)/n) it stays in [0, 1] and does not shrink to a point at
    k = 0 or k = n, where held-out accuracies per task kind often sit."""
    if n <= 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_change_interval(both: int, gained: int, lost: int, neither: int, z: float = Z95) -> tuple[float, float]:
    """Interval for after - before accuracy on the same items: Newcombe's hybrid score
    interval for paired proportions (his method 10, 1998).

    With a = right on both sides, b = gained (wrong -> right), c = lost (right -> wrong),
    d = wrong on both: p_after = (a+b)/n, p_before = (a+c)/n, change D = (b-c)/n. phi is
    the correlation of the before and after verdicts, (ad - bc) / sqrt((a+b)(c+d)(a+c)(b+d)),
    with ad - bc moved n/2 towards 0 when positive (Newcombe's correction) and phi = 0
    when a margin is empty; the limits are change_interval's with that phi. Items that
    stay right (or wrong) make phi > 0, which narrows the interval: the change is then
    carried by the few items that flipped."""
    n = both + gained + lost + neither
    margins = (both + gained) * (lost + neither) * (both + lost) * (gained + neither)
    cross = both * neither - gained * lost
    cross = max(cross - n / 2, 0.0) if cross > 0 else cross
    return change_interval(both + gained, both + lost, n, cross / math.sqrt(margins) if margins else 0.0, z)


def change_interval(k_after: int, k_before: int, n: int, phi: float = 0.0, z: float = Z95) -> tuple[float, float]:
    """Newcombe's interval for p_after - p_before from each side's Wilson interval (l, u):
    the distances from each p to its limits, added in quadrature less 2 phi times their
    product,
        lower = D - sqrt((pa - la)^2 - 2 phi (pa - la)(ub - pb) + (ub - pb)^2)
        upper = D + sqrt((pb - lb)^2 - 2 phi (pb - lb)(ua - pa) + (ua - pa)^2).
    phi = 0 treats the two sides as independent samples (wider than the paired interval
    whenever the verdicts are positively correlated)."""
    if n <= 0:
        return -1.0, 1.0
    pa, pb = k_after / n, k_before / n
    (la, ua), (lb, ub) = wilson(k_after, n, z), wilson(k_before, n, z)
    d = pa - pb
    lower = d - math.sqrt(max(0.0, (pa - la) ** 2 - 2 * phi * (pa - la) * (ub - pb) + (ub - pb) ** 2))
    upper = d + math.sqrt(max(0.0, (pb - lb) ** 2 - 2 * phi * (pb - lb) * (ua - pa) + (ua - pa) ** 2))
    return max(-1.0, lower), min(1.0, upper)


def mcnemar_p(gained: int, lost: int) -> float:
    """Exact McNemar test: if training changed nothing, each flipped item is equally likely
    to have flipped either way, so gained ~ Binomial(m, 1/2) with m = gained + lost. The
    two-sided p doubles the smaller tail,

        p = min(1, 2 sum_{i <= min(gained, lost)} C(m, i) / 2^m),   p = 1 when m = 0."""
    m = gained + lost
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(gained, lost) + 1)) / 2 ** m
    return min(1.0, 2 * tail)
