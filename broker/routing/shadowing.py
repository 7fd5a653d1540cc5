"""The shadowed-rule check: which rules of a policy never match, because an earlier rule
takes every job they match, and which earlier rule that is.

This module owns :func:`covers` (one match takes every job of another, key by key) and
:func:`shadowed_by`, the same test for every rule of a policy at once, indexed so that
10,000 rules take under a second. broker.routing.validation reports what it finds.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from typing import Any

from broker.core.schemas import Isolation, Kind
from broker.routing.rules import GpuCountRange, Match


def covers(earlier: Match, later: Match) -> bool:
    """Every job ``later`` matches is matched by ``earlier`` (checked key by key)."""
    for key, universe in (("kind", set(Kind)), ("isolation", set(Isolation)), ("tenant", None)):
        wide, narrow = getattr(earlier, key), getattr(later, key)
        if wide is None:
            continue
        if narrow is None:
            if universe is None or not universe <= set(wide):
                return False
        elif not set(narrow) <= set(wide):
            return False
    if earlier.gpus is not None and not earlier.gpus.covers(later.gpus):
        return False
    if earlier.gpu_memory_gb is not None:
        # `later` without a memory range also takes jobs that state no memory,
        # which `earlier` never matches.
        if later.gpu_memory_gb is None or not earlier.gpu_memory_gb.covers(later.gpu_memory_gb):
            return False
    return earlier.labels.items() <= later.labels.items()


# -- the shadowed-rule check -----------------------------------------------------------
#
# Comparing every rule with every earlier one took 22 s at 2,000 rules and 217 s at
# 10,000 (issue 14). Instead, each key of a match says, for a later rule, which
# rules could still cover it on that key, as a bitset over rule positions (a Python
# int, bit i for rule i): intersecting the keys costs a few machine words per 64
# rules, and the lowest bit left below a rule's own position is the first earlier
# rule that covers it, the one the pairwise loop stopped at. Each key's bitset holds
# exactly the rules that pass that key's test in `covers`, so the findings are the
# same (tests/routing/test_shadowing.py keeps the pairwise loop as the oracle). At
# 10,000 rules it takes under a second (integration/bench/policy.py), also for
# policies built to be hard: every range bound different, or thousands of label sets.


def _bitset(positions: Iterable[int], size: int) -> int:
    raw = bytearray((size + 7) // 8)
    for position in positions:
        raw[position >> 3] |= 1 << (position & 7)
    return int.from_bytes(raw, "little")


class _ValueSets:
    """One list-valued key (kind, isolation, tenant): the rules that leave it out, and
    the rules listing each value."""

    def __init__(self, lists: list[list[Any] | None], universe: frozenset[Any] | None):
        self.universe = universe  # every value a job can have; None: unbounded (tenants)
        listing: dict[Any, list[int]] = {}
        for position, values in enumerate(lists):
            for value in set(values or ()):
                listing.setdefault(value, []).append(position)
        size = len(lists)
        self.unconstrained = _bitset((p for p, values in enumerate(lists) if values is None), size)
        self.listing = {value: _bitset(positions, size) for value, positions in listing.items()}

    def covering(self, values: list[Any] | None) -> int:
        """The rules whose list holds every value a job of ``values`` (None: any) can have."""
        wanted = self.universe if values is None else frozenset(values)
        if wanted is None:  # every tenant: no list of tenants holds them all
            return self.unconstrained
        found = -1  # all ones
        for value in wanted:
            found &= self.listing.get(value, 0)
        return self.unconstrained | found


class _AtMost:
    """One bound of one range key: the rules whose bound is at most a value, one
    bitset per distinct bound (an upper bound is given negated: at least)."""

    def __init__(self, bounds: list[float]):
        by_bound: dict[float, list[int]] = {}
        for position, bound in enumerate(bounds):
            by_bound.setdefault(bound, []).append(position)
        self.bounds = sorted(by_bound)
        self.passing: list[int] = []
        so_far = 0
        for bound in self.bounds:  # each bitset adds its bound's rules to the one before
            so_far |= _bitset(by_bound[bound], len(bounds))
            self.passing.append(so_far)

    def passing_for(self, value: float) -> int:
        at = bisect.bisect_right(self.bounds, value)
        return self.passing[at - 1] if at else 0


class _Ranges:
    """One range key (gpus, gpu_memory_gb): the rules whose range holds a later rule's."""

    def __init__(self, ranges: list[tuple[float, float]]):
        self.lows = _AtMost([low for low, _ in ranges])
        self.highs = _AtMost([-high for _, high in ranges])

    def covering(self, low: float, high: float) -> int:
        return self.lows.passing_for(low) & self.highs.passing_for(-high)


def _gpus_range(match: Match, *, earlier: bool) -> tuple[float, float]:
    if match.gpus is not None:
        return match.gpus.low, match.gpus.high
    # An earlier rule that leaves gpus out covers any count; a later one takes every
    # count a job can ask for.
    return (-math.inf, math.inf) if earlier else (GpuCountRange.lowest, math.inf)


def _memory_range(match: Match) -> tuple[float, float]:
    # Leaving gpu_memory_gb out also takes jobs that state no memory, which no rule
    # with a memory range matches. (-inf, inf) says so on both sides: as an earlier
    # rule it holds every range, and as a later one only rules that leave the key out
    # too hold it, since every written range starts at 0 or above.
    if match.gpu_memory_gb is None:
        return -math.inf, math.inf
    return match.gpu_memory_gb.low, match.gpu_memory_gb.high


class _Labels:
    """The labels key: the rules whose labels are all among a later rule's. A rule's
    labels are all among them when it has as many of them as it has labels; that
    count is kept for every rule at once, in binary, one bitset per digit."""

    def __init__(self, matches: list[Match]):
        size = len(matches)
        having: dict[tuple[str, str], list[int]] = {}
        counted: dict[int, list[int]] = {}  # how many labels -> the rules with that many
        for position, match in enumerate(matches):
            counted.setdefault(len(match.labels), []).append(position)
            for item in match.labels.items():
                having.setdefault(item, []).append(position)
        self.having = {item: _bitset(positions, size) for item, positions in having.items()}
        self.counted = {count: _bitset(positions, size) for count, positions in counted.items()}
        self._known: dict[frozenset[tuple[str, str]], int] = {}

    def covering(self, labels: Mapping[str, str]) -> int:
        held = frozenset(labels.items())
        if held in self._known:
            return self._known[held]
        digits: list[int] = []  # digit d: the rules with bit d set in how many of `held` they have
        for item in held:
            carry = self.having[item]
            for d, digit in enumerate(digits):
                if not carry:
                    break
                digits[d], carry = digit ^ carry, digit & carry
            if carry:
                digits.append(carry)
        found = 0
        for count, rules in self.counted.items():
            if count.bit_length() > len(digits):
                continue  # more labels than any rule has of `held`
            exact = rules
            for d, digit in enumerate(digits):
                exact &= digit if count >> d & 1 else ~digit
            found |= exact
        self._known[held] = found
        return found


def shadowed_by(matches: list[Match]) -> list[int | None]:
    """For each match, the position of the first earlier one that takes every job it
    matches (see :func:`covers`), or None: the rule a shadowed rule never gets past."""
    kinds = _ValueSets([m.kind for m in matches], frozenset(Kind))
    isolations = _ValueSets([m.isolation for m in matches], frozenset(Isolation))
    tenants = _ValueSets([m.tenant for m in matches], None)
    labels = _Labels(matches)
    gpus = _Ranges([_gpus_range(m, earlier=True) for m in matches])
    memory = _Ranges([_memory_range(m) for m in matches])
    found: list[int | None] = []
    for position, match in enumerate(matches):
        covering = (
            kinds.covering(match.kind)
            & isolations.covering(match.isolation)
            & tenants.covering(match.tenant)
            & gpus.covering(*_gpus_range(match, earlier=False))
            & memory.covering(*_memory_range(match))
            & labels.covering(match.labels)
            & ((1 << position) - 1)  # earlier rules only
        )
        found.append((covering & -covering).bit_length() - 1 if covering else None)
    return found
