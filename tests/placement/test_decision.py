"""The one placement decision (broker.placement.decision): what each outcome says and
does, on a capacity the test controls."""

from __future__ import annotations

from dataclasses import dataclass

from broker.core.adapter import Placement, Sharing
from broker.core.schemas import JobSpec
from broker.placement.capacity import Fit, NoFit
from broker.placement.decision import NO_POLICY, CycleDecisions, Held, Placed, WaitCause, Waiting
from broker.placement.fairshare import FairShare
from broker.routing.policy import load_policy

POLICY = load_policy(
    """
rules:
  - name: mig
    match: {kind: training, isolation: hardware}
    route: {cluster: slurm-a, sharing: slurm/mig}
    fallbacks: [{cluster: k8s-a, sharing: k8s/mig}]
"""
)


@dataclass
class Job:
    spec: JobSpec
    tenant: str = "ml"

    @property
    def asked(self) -> JobSpec:
        return self.spec


def job(**fields) -> Job:
    spec = {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 5, "command": ["x"], **fields}
    return Job(JobSpec.model_validate(spec))


class Capacity:
    """Answers per cluster as the test says; counts what was taken and given back."""

    def __init__(self, **answers) -> None:
        self.answers = answers  # cluster -> "fit" | "wait" | "never"
        self.taken: list[str] = []
        self.undone: list[str] = []

    def fit_route(self, job, route) -> Fit | NoFit:
        answer = self.answers[route.cluster]
        if answer == "fit":
            self.taken.append(route.cluster)
            return Fit(Placement(route.cluster, Sharing(route.sharing), 1, 1 / 7, node="n1", mig_profile="1g.5gb"))
        if answer == "wait":
            return NoFit(
                f"waiting for 1g.5gb on {route.cluster} (0 of 7 free)",
                never=False,
                waiting_for=(route.cluster, route.sharing, "1g.5gb", None),
            )
        return NoFit(f"{route.cluster} offers no {route.sharing} GPUs", never=True)

    def undo(self, fit: Fit) -> None:
        self.undone.append(fit.placement.cluster)


def test_no_active_policy_holds_every_job_saying_what_an_admin_does() -> None:
    outcome = CycleDecisions(None, Capacity(), FairShare({}, {})).decide(job())
    assert outcome == Held(NO_POLICY) and "gpush policy apply" in outcome.reason


def test_no_matching_rule_holds_the_job_with_the_policys_reason() -> None:
    outcome = CycleDecisions(POLICY, Capacity(), FairShare({}, {})).decide(job(kind="inference", isolation="none"))
    assert isinstance(outcome, Held) and outcome.reason.startswith("held: ")


def test_the_first_route_with_room_takes_the_job_and_its_tenant_is_charged() -> None:
    fair = FairShare({}, {})
    capacity = Capacity(**{"slurm-a": "wait", "k8s-a": "fit"})
    outcome = CycleDecisions(POLICY, capacity, fair).decide(job())
    assert isinstance(outcome, Placed) and outcome.placement.cluster == "k8s-a"
    assert fair.usage == {"ml": 1 / 7}


def test_over_quota_gives_the_fit_back_and_waits_saying_so() -> None:
    fair = FairShare({}, {"ml": 0.1})
    capacity = Capacity(**{"slurm-a": "fit", "k8s-a": "fit"})
    outcome = CycleDecisions(POLICY, capacity, fair).decide(job())
    assert outcome == Waiting("tenant ml at quota (0/0.1 GPU)", WaitCause.QUOTA)
    assert capacity.undone == ["slurm-a"] and fair.usage == {}


def test_no_room_now_waits_for_the_first_route_that_could_and_counts_the_jobs_ahead() -> None:
    decisions = CycleDecisions(POLICY, Capacity(**{"slurm-a": "wait", "k8s-a": "never"}), FairShare({}, {}))
    reasons = [decisions.decide(job()).reason for _ in range(3)]
    assert reasons == [
        "waiting for 1g.5gb on slurm-a (0 of 7 free)",
        "waiting for 1g.5gb on slurm-a (0 of 7 free, 1 job ahead)",
        "waiting for 1g.5gb on slurm-a (0 of 7 free, 2 jobs ahead)",
    ]
    # A replay that skips a job of a kind that found no room says the same as deciding it.
    first = CycleDecisions(POLICY, Capacity(**{"slurm-a": "wait", "k8s-a": "never"}), FairShare({}, {}))
    seen = first.decide(job())
    assert [first.behind(seen).reason for _ in range(2)] == reasons[1:]


def test_a_job_no_route_could_ever_hold_is_held_with_every_routes_reason() -> None:
    outcome = CycleDecisions(POLICY, Capacity(**{"slurm-a": "never", "k8s-a": "never"}), FairShare({}, {})).decide(
        job()
    )
    assert outcome == Held(
        "held: can never fit: slurm-a offers no slurm/mig GPUs; k8s-a offers no k8s/mig GPUs "
        "(routed by rule 'mig': `gpush policy explain` shows every rule)"
    )


def test_a_reason_without_a_count_in_parentheses_gets_one() -> None:
    class Bare(Capacity):
        def fit_route(self, job, route):
            return NoFit(f"waiting for 500 milli-GPU on {route.cluster}", never=False, waiting_for=("x",))

    decisions = CycleDecisions(POLICY, Bare(), FairShare({}, {}))
    decisions.decide(job())
    assert decisions.decide(job()).reason == "waiting for 500 milli-GPU on slurm-a (1 job ahead)"
