"""Deterministic Miller-Rabin, the one primality test the hash layouts share."""

from __future__ import annotations

__all__ = ["MR_EXACT_BELOW", "miller_rabin"]

# The smallest composite that passes every base up to 37 is
# 318,665,857,834,031,151,167,461 ~ 3.2e23 (Sorenson and Webster 2015), far above 2**64.
_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
MR_EXACT_BELOW = 318_665_857_834_031_151_167_461


def miller_rabin(n: int) -> bool:
    """Exact primality of ``n`` for ``n < MR_EXACT_BELOW`` (every 64-bit integer);
    raises ``ValueError`` above. Callers with a tighter contract check it first."""
    if n < 2:
        return False
    for p in _BASES:
        if n % p == 0:
            return n == p
    if n >= MR_EXACT_BELOW:
        raise ValueError(f"is_prime(n={n}) is exact only below {MR_EXACT_BELOW}")
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True
