"""Alternating timing: every variant of a comparison runs in the same process, in turns.

A rep times `steps` calls of each variant, one after another; the order is reversed
every other rep (A B C, C B A, ...) so slow drifts of a shared machine (another job
starting, CPU frequency) fall on every variant alike. The ratio of two variants is
taken per rep (times measured seconds apart), and reported as the median and the
spread (min, max) over the reps. Warm-up calls (tracing, first allocations) are
excluded.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List


@dataclass
class Ratio:
    """Time of `a` over time of `b` per rep: > 1 means `a` is slower."""

    a: str
    b: str
    per_rep: List[float]

    @property
    def median(self) -> float:
        return statistics.median(self.per_rep)

    @property
    def low(self) -> float:
        return min(self.per_rep)

    @property
    def high(self) -> float:
        return max(self.per_rep)

    def as_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "median": self.median, "min": self.low, "max": self.high,
                "per_rep": self.per_rep}


@dataclass
class Timings:
    """Seconds per step of each variant, one entry per rep."""

    per_step: Dict[str, List[float]] = field(default_factory=dict)

    def ratio(self, a: str, b: str) -> Ratio:
        return Ratio(a, b, [ta / tb for ta, tb in zip(self.per_step[a], self.per_step[b])])

    def median_ms(self, name: str) -> float:
        return 1e3 * statistics.median(self.per_step[name])


def alternate(variants: Dict[str, Callable[[int], None]], reps: int, steps: int, warmup: int = 3,
              block_seconds: float = 0.0, multiple: int = 1, agree: Callable[[int], int] | None = None) -> Timings:
    """Times each `variants[name](n)` (runs n steps and waits for them) in alternation.

    Args:
      variants: name -> function running n steps to completion.
      reps: how many turns; each turn times every variant once.
      steps: steps per timed call (the least, with `block_seconds`).
      warmup: untimed steps of each variant first.
      block_seconds: if positive, raise `steps` so that one timed call of the slowest
        variant lasts about this long (a short block is mostly the machine's noise).
      multiple: the step count is rounded up to a multiple of this (e.g. the
        accumulation window, so every variant times whole windows).
      agree: maps this process's calibrated step count to the one every process uses
        (processes that run collectives together must run the same steps).

    Returns:
      `Timings`, seconds per step per rep.
    """
    names = list(variants)
    for name in names:
        variants[name](warmup)
    if block_seconds > 0:
        slowest = 0.0
        for name in names:
            start = time.perf_counter()
            variants[name](multiple)
            slowest = max(slowest, (time.perf_counter() - start) / multiple)
        steps = max(steps, int(block_seconds / max(slowest, 1e-6)))
        if agree is not None:
            steps = agree(steps)
    steps = -(-steps // multiple) * multiple
    out = Timings({name: [] for name in names})
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            start = time.perf_counter()
            variants[name](steps)
            out.per_step[name].append((time.perf_counter() - start) / steps)
    return out


# A focused comparison: short blocks, many turns, several builds. Measured on this 2-core
# machine (MLP of 20 variables, MirroredStrategy, 101 turns of 0.1 s): the anchor against
# a second copy of itself 0.989-1.001 (median), where six variants in 0.4 s blocks gave
# 0.92-1.08 per turn. But a build keeps its own speed for the life of the process (memory
# layout, thread placement): three copies of the same hand-written step ran 6.12, 6.34
# and 6.48 ms (41 turns), so one copy of each side measures the luck of two builds as
# much as the two steps. Each side is therefore several independently built copies, every
# copy timed in every turn, a turn's time of a side the mean over its copies.
FOCUS_REPS, FOCUS_BLOCK_SECONDS, FOCUS_COPIES = 61, 0.1, 3


@dataclass
class Focused:
    """`a` against `b`, and the A/A control: a second set of copies of `b` against `b`."""

    ratio: Ratio
    control: Ratio
    timings: Timings


def focused(a, b, b_again, reps: int = FOCUS_REPS, block_seconds: float = FOCUS_BLOCK_SECONDS,
            agree: Callable[[int], int] | None = None) -> Focused:
    """Times `a`, `b` and `b_again` (`b` built again, independently) alone, in short
    alternating blocks: the ratio that a check reads, and beside it the control, whose
    distance from 1 is what this machine's noise does to the same comparison.

    Each of `a`, `b`, `b_again` is a function running n steps, or a list of such
    functions, one per independently built copy (`FOCUS_COPIES`); the copies of the
    three sides are interleaved in every turn, and a side's time in a turn is the mean
    over its copies. `timings` holds those per-side times ("a", "b", "b_again").
    """
    sides = {name: list(fns) if isinstance(fns, (list, tuple)) else [fns]
             for name, fns in (("a", a), ("b", b), ("b_again", b_again))}
    variants = {f"{name}#{j}": sides[name][j]
                for j in range(max(len(v) for v in sides.values())) for name in sides if j < len(sides[name])}
    t = alternate(variants, reps=reps, steps=1, block_seconds=block_seconds, agree=agree)
    merged = Timings({name: [statistics.fmean(turn) for turn in zip(*(t.per_step[f"{name}#{j}"]
                                                                     for j in range(len(fns))))]
                      for name, fns in sides.items()})
    return Focused(merged.ratio("a", "b"), merged.ratio("b_again", "b"), merged)


def loopback_sent() -> int:
    """Bytes sent over the loopback interface so far, by every process of the machine."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    raise KeyError("lo")
