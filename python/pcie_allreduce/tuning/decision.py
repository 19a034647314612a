"""How a size bucket's winner is chosen from its timings: robust medians, the noise of a ratio
of back-to-back timings, and the rule that keeps the incumbent unless a challenger wins by more
than that noise. Pure functions of the gathered numbers, so every rank decides the same."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# A challenger must win by more than the noise, and by at least 5 % against a guess (the seed
# or a given table) or 10 % against a measured choice (the cache): on a shared machine the
# ratio of two tactics itself drifts a few percent between runs, and a choice that flips on
# that drift is worth less than the few percent it would gain.
MIN_MARGIN = 0.05
MIN_MARGIN_MEASURED = 0.10


def median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def median_and_error(samples: Sequence[float]) -> tuple[float, float]:
    """(median, relative standard error of the median), the error from the median absolute
    deviation: robust to the slow outliers a shared machine produces."""
    med = median(samples)
    if len(samples) < 2 or med <= 0:
        return med, 1.0
    mad = median([abs(s - med) for s in samples])
    return med, 1.253 * 1.4826 * mad / med / len(samples) ** 0.5


def ratio_and_error(challenger: Sequence[float], incumbent: Sequence[float]) -> tuple[float, float]:
    """Median of the per-round time ratios and its standard error (absolute)."""
    ratios = [c / i for c, i in zip(challenger, incumbent) if i > 0]
    med, rel = median_and_error(ratios)
    return med, rel * med


def keep_or_replace(
    incumbent: str | None, samples: Mapping[str, Sequence[float]], min_margin: float = MIN_MARGIN
) -> tuple[str, float, float]:
    """(winner, challenger/incumbent time ratio, margin it had to beat). The incumbent stays
    unless the fastest challenger beats it by more than ``min_margin`` and by more than three
    standard errors of the per-round ratio. Each round times both back to back, so the ratio
    cancels the slow and fast phases of a shared machine that the times themselves carry: two
    tunes of one host choose the same."""
    if incumbent is None or incumbent not in samples:
        medians = {label: median(times) for label, times in samples.items() if times}
        return min(medians, key=medians.__getitem__), 1.0, 0.0
    ratios = {
        label: ratio_and_error(times, samples[incumbent])
        for label, times in samples.items()
        if label != incumbent and times
    }
    if not ratios:
        return incumbent, 1.0, 0.0
    best = min(ratios, key=lambda label: ratios[label][0])
    ratio, error = ratios[best]
    margin = max(min_margin, 3.0 * error)
    return (best if ratio < 1.0 - margin else incumbent), ratio, margin
