"""Which tenant's job goes next, and when a quota makes a job wait (broker.placement.fairshare)."""

from __future__ import annotations

import pytest

from broker.placement.fairshare import FairShare


def place_one_at_a_time(fair: FairShare, slots: int, wanting: dict[str, int]) -> dict[str, int]:
    """Fill ``slots`` GPUs one job at a time as the scheduling cycle does; jobs placed per tenant."""
    placed = dict.fromkeys(wanting, 0)
    for _ in range(slots):
        heads = [(tenant, 0, placed[tenant]) for tenant in wanting if placed[tenant] < wanting[tenant]]
        tenant = fair.next_tenant(heads)
        if tenant is None:
            break
        fair.charge(tenant, 1.0)
        placed[tenant] += 1
    return placed


def test_the_tenant_furthest_below_its_weighted_share_goes_next() -> None:
    fair = FairShare({"a": 3, "b": 1}, {}, {"a": 6.0, "b": 1.0}, waiting=["a", "b"])
    # a holds 6/7 of what is in use against a share of 3/4; b 1/7 against 1/4.
    assert fair.share("a") == pytest.approx(0.75)
    assert fair.deficit("a") == pytest.approx(0.75 - 6 / 7)
    assert fair.deficit("b") == pytest.approx(0.25 - 1 / 7)
    assert fair.next_tenant([("a", 0, 1), ("b", 0, 2)]) == "b"


def test_weights_divide_a_contended_pool() -> None:
    fair = FairShare({"a": 3, "b": 1}, {}, waiting=["a", "b"])
    assert place_one_at_a_time(fair, 8, {"a": 12, "b": 12}) == {"a": 6, "b": 2}
    assert fair.usage == {"a": 6.0, "b": 2.0} and fair.in_use == 8.0


def test_priority_beats_deficit() -> None:
    fair = FairShare({"a": 1, "b": 1}, {}, {"a": 7.0}, waiting=["a", "b"])
    # a holds everything, yet its priority 10 job goes before b's priority 0 job.
    assert fair.next_tenant([("a", 10, 5), ("b", 0, 1)]) == "a"
    # At equal priority, b (holding nothing) goes first.
    assert fair.next_tenant([("a", 0, 5), ("b", 0, 1)]) == "b"


def test_age_breaks_a_tie_of_priority_and_deficit() -> None:
    fair = FairShare({}, {}, waiting=["a", "b"])
    assert fair.next_tenant([("a", 0, 20), ("b", 0, 10)]) == "b"
    assert fair.next_tenant([]) is None


def test_a_lone_tenant_may_use_everything() -> None:
    fair = FairShare({"a": 1, "idle": 9}, {}, waiting=["a"])
    # "idle" holds nothing and waits for nothing: it does not share, so a's share is all.
    assert fair.share("a") == 1.0
    assert place_one_at_a_time(fair, 36, {"a": 100}) == {"a": 36}
    assert fair.over_quota("a", 100.0) is None


def test_a_quota_makes_a_job_wait_with_the_reason_then_frees() -> None:
    fair = FairShare({}, {"nlp": 8}, {"nlp": 7.0})
    assert fair.over_quota("nlp", 1.0) is None  # exactly at the quota is allowed
    fair.charge("nlp", 1.0)
    assert fair.over_quota("nlp", 1 / 7) == "tenant nlp at quota (8/8 GPU)"
    assert fair.over_quota("vision", 100.0) is None  # no quota: no cap
    fair.release("nlp", 2.0)
    assert fair.over_quota("nlp", 2.0) is None


def test_slices_that_add_up_to_the_quota_are_not_over_it() -> None:
    fair = FairShare({}, {"nlp": 5})
    for _ in range(34):
        fair.charge("nlp", 1 / 7)
    assert fair.usage["nlp"] + 1 / 7 > 5  # 35 sevenths in floating point are a hair over 5
    assert fair.over_quota("nlp", 1 / 7) is None
    assert fair.over_quota("nlp", 2 / 7) == "tenant nlp at quota (4.85714/5 GPU)"


def test_a_tenant_holding_nothing_stops_sharing_once_it_no_longer_waits() -> None:
    fair = FairShare({"a": 1, "b": 3}, {}, {"b": 2.0})
    assert fair.share("b") == 1.0  # alone: b holds GPUs, nobody waits
    fair.contend(["a"])
    assert fair.share("b") == pytest.approx(0.75)
    fair.release("b", 2.0)
    assert fair.usage == {} and fair.in_use == 0.0
    fair.contend(["a"])
    assert fair.share("a") == 1.0
