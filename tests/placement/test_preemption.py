"""Choosing victims (broker.placement.preemption): only preemptible jobs of lower standing,
in the order that loses the least, never more than the waiting job needs, and fair-share
reclaiming rate-limited."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from broker.placement.preemption import Running, Terms, Waiting, choose_victims, standing

NOW = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)


def job(job_id, tenant="ml", priority=0, preemptible=True, started=60, checkpoint=None) -> Running:
    return Running(
        job_id,
        tenant,
        priority,
        preemptible,
        NOW - timedelta(minutes=started),
        None if checkpoint is None else NOW - timedelta(minutes=checkpoint),
    )


def needs(gpus: int, size: dict[int, int]):
    """A fit that needs ``gpus`` GPUs freed; each victim frees size[job_id] (default 1)."""
    return lambda victims: sum(size.get(v.job_id, 1) for v in victims) >= gpus


URGENT = Waiting(100, "ops", priority=10)


def test_a_job_that_is_not_preemptible_is_never_touched():
    running = [job(1, preemptible=False), job(2, preemptible=False)]
    assert choose_victims(URGENT, running, needs(1, {}), terms=Terms(), share_gap={}, now=NOW) is None


def test_lowest_priority_then_least_work_since_the_last_checkpoint():
    running = [
        job(1, priority=5, started=10),
        job(2, priority=0, started=300, checkpoint=2),  # long run, checkpointed 2 min ago
        job(3, priority=0, started=30),  # 30 min of work at risk
        job(4, priority=10),  # same priority as the waiting job: not below it
    ]
    choice = choose_victims(URGENT, running, needs(1, {}), terms=Terms(), share_gap={}, now=NOW)
    assert [v.job_id for v in choice.victims] == [2]
    assert choice.reason(URGENT) == "preempted by job 100 (priority 10, tenant ops)"
    two = choose_victims(URGENT, running, needs(2, {}), terms=Terms(), share_gap={}, now=NOW)
    assert [v.job_id for v in two.victims] == [2, 3]


def test_never_more_than_the_waiting_job_needs():
    # Job 2 alone frees the 4 GPUs needed: job 1, taken first, is given back.
    running = [job(1, priority=0, started=1), job(2, priority=0, started=50)]
    choice = choose_victims(URGENT, running, needs(4, {1: 1, 2: 4}), terms=Terms(), share_gap={}, now=NOW)
    assert [v.job_id for v in choice.victims] == [2]
    # And when no set fits, nothing is preempted.
    assert choose_victims(URGENT, running, needs(9, {1: 1, 2: 4}), terms=Terms(), share_gap={}, now=NOW) is None


def test_priority_gap_and_fair_share_reclaiming_with_its_rate_limit():
    same = Waiting(200, "cv", priority=0)
    running = [job(1, tenant="ml", priority=0), job(2, tenant="ml", priority=0)]
    gap = {"cv": -4.0, "ml": 6.0}  # cv is below its share, ml above
    assert standing(same, running[0], Terms(), gap) is None  # reclaiming is off by default
    terms = Terms(reclaim=True, reclaims_per_hour=1)
    choice = choose_victims(same, running, needs(1, {}), terms=terms, share_gap=gap, now=NOW)
    assert choice.why == "reclaim" and "reclaims its fair share" in choice.reason(same)
    # The hour's one reclaim is spent: no more until it has passed.
    spent = [NOW - timedelta(minutes=20)]
    assert (
        choose_victims(same, running, needs(1, {}), terms=terms, share_gap=gap, now=NOW, recent_reclaims=spent) is None
    )
    assert choose_victims(same, running, needs(2, {}), terms=terms, share_gap=gap, now=NOW) is None  # 1 an hour
    # A tenant at or below its share is not reclaimed from.
    assert choose_victims(same, running, needs(1, {}), terms=terms, share_gap={"cv": -4.0, "ml": 0.0}, now=NOW) is None
    # A higher gap is needed when the policy says so.
    assert standing(Waiting(1, "ops", 3), job(9, priority=1), Terms(min_priority_gap=5), {}) is None
