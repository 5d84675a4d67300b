"""Run-to-run spread, and the rule that keeps a table from ranking figures the spread cannot tell apart.

A benchmark that repeats each measurement ``N`` times summarizes it as :class:`Spread`: the median and the
closed interval ``[min, max]`` of the repeats. Two figures whose intervals overlap are "within noise": a table
says so instead of ranking them, because another run could well put them in the other order. With fewer than
two repeats there is no spread to judge by, and the table says that instead. Plain Python: the table renderers
import it without torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Spread", "overlaps", "compare", "difference", "ordering", "WITHIN_NOISE", "NO_SPREAD"]

WITHIN_NOISE = "within noise"
NO_SPREAD = "no spread (1 repeat)"


@dataclass(frozen=True)
class Spread:
    """The median of ``n`` repeats of one measurement and the interval ``[lo, hi]`` they span."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, samples: Iterable[float]) -> Spread:
        values = [float(v) for v in samples]
        if not values:
            raise ValueError("a spread needs at least one sample, got none")
        return cls(statistics.median(values), min(values), max(values), len(values))

    @classmethod
    def from_dict(cls, d: dict) -> Spread:
        return cls(float(d["median"]), float(d["min"]), float(d["max"]), int(d["n"]))

    def as_dict(self) -> dict:
        return dict(median=self.median, min=self.lo, max=self.hi, n=self.n)

    def text(self, digits: int = 2) -> str:
        """``1.79 (1.70–1.85)``, or the median alone for one repeat."""
        if self.n < 2:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} ({self.lo:.{digits}f}–{self.hi:.{digits}f})"


def overlaps(a: Spread, b: Spread) -> bool:
    """Whether the closed intervals of ``a`` and ``b`` share a point."""
    return a.lo <= b.hi and b.lo <= a.hi


def compare(a: Spread, b: Spread) -> str:
    """``"lower"`` or ``"higher"`` (``a`` against ``b``) where their intervals are apart, :data:`WITHIN_NOISE`
    where they overlap, :data:`NO_SPREAD` where either was measured once (no interval to judge by)."""
    if a.n < 2 or b.n < 2:
        return NO_SPREAD
    if overlaps(a, b):
        return WITHIN_NOISE
    return "lower" if a.median < b.median else "higher"


def difference(a: Spread, ref: Spread, unit: str = "", relative: bool = False) -> str:
    """``a`` against the reference ``ref`` as a table cell: the signed difference of the medians (in ``unit``, or
    in percent of ``ref`` with ``relative``) where the intervals are apart, else what :func:`compare` says."""
    verdict = compare(a, ref)
    if verdict in (WITHIN_NOISE, NO_SPREAD):
        return verdict
    if relative:
        return f"{100 * (a.median - ref.median) / ref.median:+.1f}%"
    return f"{a.median - ref.median:+.2f}{unit}"


def ordering(rows: Sequence[tuple[str, Spread]], lower_is_better: bool = True) -> str:
    """The rows best first, as ``"A ≈ B < C"``: ``<`` (``>`` for higher-is-better) between neighbours whose
    intervals are apart, ``≈`` between neighbours within noise. Medians order the rows; the symbols only say which
    steps of that order the repeats can vouch for. Empty with fewer than two repeats anywhere."""
    if not rows or any(s.n < 2 for _, s in rows):
        return ""
    ranked = sorted(rows, key=lambda r: r[1].median, reverse=not lower_is_better)
    text = ranked[0][0]
    for (_, prev), (name, cur) in zip(ranked, ranked[1:]):
        text += f" {'≈' if overlaps(prev, cur) else ('<' if lower_is_better else '>')} {name}"
    return text
