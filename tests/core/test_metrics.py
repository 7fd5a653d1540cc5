"""GET /metrics as Prometheus scrapes it, and the Grafana dashboard that reads it.

Process metrics (cycles, adapter calls, GPU-equivalents) live in one registry for the
whole test process, so tests compare counters before and after what they do.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from broker.api import metrics as exported
from broker.core import metrics
from broker.core.adapter import BatchSubmitter, Unreachable
from broker.core.clusters import AdapterPool, add_cluster, list_clusters
from broker.core.metrics import REGISTRY
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from broker.scheduling.cycle import Scheduler

ROOT = Path(__file__).resolve().parents[2]
FLEET = (ROOT / "examples" / "fleet.yaml").read_text()
DEFAULT_POLICY = (ROOT / "policies" / "default.yaml").read_text()
DASHBOARD = ROOT / "dashboards" / "grafana" / "gpush.json"
TRAIN = {"kind": "training", "gpus": 2, "command": ["python", "train.py"]}
INFER = {"kind": "inference", "gpu_memory_gb": 8, "image": "serve:1"}


@pytest.fixture
def fleet(sessions, clock) -> AdapterPool:
    """slurm-a and k8s-a of examples/fleet.yaml registered, the default policy active."""
    pool = AdapterPool(clock)
    with sessions() as session, session.begin():
        for name in ("slurm-a", "k8s-a"):
            add_cluster(session, name=name, kind="sim", config={"fleet_yaml": FLEET}, actor="root", now=clock())
        views = cluster_views(session, pool)
        policystore.apply(
            session, DEFAULT_POLICY, comment="test", author="root", now=clock(), views=views, base_version=None
        )
    return pool


def scrape(http, **headers) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics without a token, parsed as Prometheus parses it: value per (sample, labels)."""
    response = http(token=None).get("/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def queue_depth(samples) -> dict[tuple[str, str, str], float]:
    return {
        (labels["state"], labels["tenant"], labels["kind"]): value
        for (name, pairs), value in samples.items()
        if name == "gpush_queue_jobs"
        for labels in [dict(pairs)]
    }


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def cluster_info(sessions, name: str):
    with sessions() as session:
        (info,) = [c for c in list_clusters(session) if c.name == name]
    return info


# -- queue depth --------------------------------------------------------------------------


def test_queue_depth_counts_unfinished_jobs_by_state_tenant_and_kind(http):
    ml, vision = http(user="alice", tenant="ml"), http(user="bob", tenant="vision")
    for _ in range(3):
        assert ml.post("/v1/jobs", json=TRAIN).status_code == 201
    inference = ml.post("/v1/jobs", json=INFER).json()["id"]
    assert vision.post("/v1/jobs", json=TRAIN).status_code == 201
    samples = scrape(http)
    assert samples[("gpush_database_up", ())] == 1
    assert queue_depth(samples) == {
        ("queued", "ml", "training"): 3,
        ("queued", "ml", "inference"): 1,
        ("queued", "vision", "training"): 1,
    }
    # A cancelled job is finished: it leaves the gauge, which says 0 rather than vanishing.
    assert ml.post(f"/v1/jobs/{inference}/cancel").status_code == 200
    assert queue_depth(scrape(http))[("queued", "ml", "inference")] == 0


def test_metrics_need_no_token_unless_one_is_configured(http, monkeypatch):
    assert http(token=None).get("/metrics").status_code == 200
    monkeypatch.setenv(metrics.TOKEN_ENV, "s3cret")
    refused = http(token=None).get("/metrics")
    assert refused.status_code == 401 and metrics.TOKEN_ENV in refused.json()["error"]["message"]
    assert http(token=None).get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert scrape(http, Authorization="Bearer s3cret")[("gpush_database_up", ())] == 1


def test_openmetrics_is_served_to_a_scraper_that_asks_for_it(http):
    response = http(token=None).get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    names = {family.name for family in openmetrics_families(response.text)}
    assert {"gpush_queue_jobs", "gpush_scheduler_cycle_seconds", "gpush_adapter_call_errors"} <= names


def test_a_process_without_the_api_serves_the_same_metrics_on_its_own_port(engine, http):
    assert http(user="alice", tenant="ml").post("/v1/jobs", json=TRAIN).status_code == 201
    server, thread = exported.serve(engine, 0)
    try:
        text = httpx.get(f"http://127.0.0.1:{server.server_port}/metrics").text
    finally:
        server.shutdown()
        thread.join(timeout=5)
    samples = {
        (s.name, s.labels.get("state")): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }
    assert samples[("gpush_queue_jobs", "queued")] == 1
    assert ("gpush_scheduler_cycle_seconds_count", None) in samples


# -- scheduler cycles and inventory ---------------------------------------------------------


def test_a_cycle_is_timed_and_sets_gpu_equivalents_per_cluster_and_sharing(engine, sessions, clock, fleet, http):
    ml = http(user="alice", tenant="ml")
    for _ in range(2):
        assert ml.post("/v1/jobs", json=TRAIN).status_code == 201
    cycles = value("gpush_scheduler_cycle_seconds_count")
    placed = value("gpush_scheduler_jobs_total", outcome="placed")
    scheduler = Scheduler(engine, fleet, clock=clock)
    assert scheduler.run_cycle().placed == 2
    scheduler.run_cycle()  # reads the inventory with both jobs on it
    assert value("gpush_scheduler_cycle_seconds_count") == cycles + 2
    assert value("gpush_scheduler_jobs_total", outcome="placed") == placed + 2
    assert value("gpush_scheduler_cycle_step_seconds_count", step="sync") >= 2

    samples = scrape(http)
    whole = (("cluster", "slurm-a"), ("sharing", "slurm/exclusive"))
    # slurm-a has 8 whole A100-80GB; the two jobs hold 2 GPUs each.
    assert samples[("gpush_cluster_gpu_equivalents_capacity", whole)] == 8
    assert samples[("gpush_cluster_gpu_equivalents_allocated", whole)] == 4
    assert samples[("gpush_cluster_gpu_equivalents_free", whole)] == 4
    # Every sharing mode the clusters offer, in physical GPU-equivalents as their inventories say.
    for name in ("slurm-a", "k8s-a"):
        expected: dict[str, float] = {}
        for unit in fleet.get(cluster_info(sessions, name)).inventory():
            expected[unit.sharing.value] = expected.get(unit.sharing.value, 0) + unit.capacity * unit.gpu_equivalent
        exported = {
            dict(pairs)["sharing"]: v
            for (metric, pairs), v in scrape(http).items()
            if metric == "gpush_cluster_gpu_equivalents_capacity" and dict(pairs)["cluster"] == name
        }
        assert exported == pytest.approx(expected)
    assert queue_depth(samples) == {("running", "ml", "training"): 2}


def test_an_unreachable_cluster_counts_errors_and_its_capacity_goes_away(engine, sessions, clock, fleet, http):
    scheduler = Scheduler(engine, fleet, clock=clock)
    scheduler.run_cycle()
    assert value("gpush_cluster_gpu_equivalents_capacity", cluster="slurm-a", sharing="slurm/exclusive") == 8
    labels = {"cluster": "slurm-a", "kind": "sim", "error": "Unreachable"}
    before = {m: value("gpush_adapter_call_errors_total", method=m, **labels) for m in ("statuses", "inventory")}
    calls = value("gpush_adapter_call_seconds_count", cluster="slurm-a", kind="sim", method="inventory")

    fleet.get(cluster_info(sessions, "slurm-a")).adapter.simulate_outage("slurmctld not responding")
    report = scheduler.run_cycle()

    assert any("slurmctld not responding" in e for e in report.errors)
    for method in ("statuses", "inventory"):
        assert value("gpush_adapter_call_errors_total", method=method, **labels) == before[method] + 1
    assert value("gpush_adapter_call_seconds_count", cluster="slurm-a", kind="sim", method="inventory") == calls + 1
    samples = scrape(http)
    assert not [
        k for k in samples if k[0].startswith("gpush_cluster_gpu_equivalents") and ("cluster", "slurm-a") in k[1]
    ]
    assert ("gpush_cluster_gpu_equivalents_capacity", (("cluster", "k8s-a"), ("sharing", "k8s/exclusive"))) in samples
    key = (
        "gpush_adapter_call_errors_total",
        (("cluster", "slurm-a"), ("error", "Unreachable"), ("kind", "sim"), ("method", "inventory")),
    )
    assert samples[key] == before["inventory"] + 1


def test_an_adapter_bug_is_counted_as_unexpected(sessions, fleet):
    class Broken:
        name = "k8s-a"
        capabilities = frozenset({BatchSubmitter})

        def health(self):
            raise KeyError("nodes")

        def submit_many(self, items):
            return [Unreachable("apiserver timeout") for _ in items]

    fleet.override("k8s-a", Broken())
    adapter = fleet.get(cluster_info(sessions, "k8s-a"))
    labels = {"cluster": "k8s-a", "kind": "sim"}
    bugs = value("gpush_adapter_call_errors_total", method="health", error="unexpected", **labels)
    unanswered = value("gpush_adapter_call_errors_total", method="submit_many", error="Unreachable", **labels)
    with pytest.raises(KeyError):
        adapter.health()
    assert len(adapter.submit_many([(1, None, None), (2, None, None)])) == 2
    assert value("gpush_adapter_call_errors_total", method="health", error="unexpected", **labels) == bugs + 1
    assert value("gpush_adapter_call_errors_total", method="submit_many", error="Unreachable", **labels) == (
        unanswered + 2
    )
    assert fleet.get(cluster_info(sessions, "k8s-a")).name == "k8s-a"  # the rest passes through


# -- drift findings -------------------------------------------------------------------------


def test_drift_findings_are_counted_by_cluster_kind_and_severity(http):
    class Severity(Enum):
        ERROR = "error"
        WARNING = "warning"

    def finding(kind, severity, cluster=None):
        return SimpleNamespace(kind=kind, severity=severity, cluster=cluster)

    def drift() -> dict:
        return {pairs: v for (name, pairs), v in scrape(http).items() if name == "gpush_drift_findings"}

    metrics.observe_findings(
        [
            finding("mig_layout", Severity.ERROR, "slurm-a"),
            finding("mig_layout", Severity.ERROR, "slurm-a"),
            finding("missing_node", Severity.WARNING, "k8s-a"),
        ]
    )
    mig = (("cluster", "slurm-a"), ("kind", "mig_layout"), ("severity", "error"))
    node = (("cluster", "k8s-a"), ("kind", "missing_node"), ("severity", "warning"))
    assert {k: v for k, v in drift().items() if v} == {mig: 2, node: 1}
    # One cluster reconciled again, clean: only its findings go, and say 0.
    metrics.observe_findings([], cluster="slurm-a")
    assert (drift()[mig], drift()[node]) == (0, 1)
    metrics.observe_findings([])
    assert (drift()[mig], drift()[node]) == (0, 0)


# -- the dashboard --------------------------------------------------------------------------

# What PromQL spells that is not a metric: operators, modifiers, literals.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, regexes
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables
    names = re.findall(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()", expr)  # a name not called as a function
    return {n for n in names if n.lower() not in _KEYWORDS}


def exported_names(engine) -> set[str]:
    """Every sample name the broker's /metrics may carry (a histogram's _bucket, ...)."""
    suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_count", "_sum", "_created"]}
    text = generate_latest(exported.app_registry(engine)).decode()
    return {
        family.name + suffix
        for family in text_string_to_metric_families(text)
        for suffix in suffixes.get(family.type, [""])
    }


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return out


def test_metric_names_are_read_out_of_promql():
    assert metric_names(
        'histogram_quantile(0.95, sum by (le, cluster) (rate(gpush_adapter_call_seconds_bucket{cluster=~"$cluster"}'
        "[$__rate_interval]))) / on (cluster) group_left sum(up) > bool 1e3"
    ) == {"gpush_adapter_call_seconds_bucket", "up"}
    assert metric_names("time() - max(gpush_scheduler_last_cycle_timestamp_seconds)") == {
        "gpush_scheduler_last_cycle_timestamp_seconds"
    }
    assert metric_names('sum(a{x="b{c}"}) by (le) / sum without (d) (b_total offset 5m)') == {"a", "b_total"}


def test_every_dashboard_query_reads_metrics_the_broker_exports(engine):
    dashboard = json.loads(DASHBOARD.read_text())
    assert 38 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (variables["DS_PROMETHEUS"]["type"], variables["DS_PROMETHEUS"]["query"]) == ("datasource", "prometheus")
    exported = exported_names(engine)
    # A variable's label_values(metric, label) reads the metric.
    queries = [
        re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", v["definition"])
        for v in variables.values()
        if v["type"] == "query"
    ]
    seen: set[str] = set()
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queries.append(target["expr"])
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
    for query in queries:
        names = metric_names(query)
        assert names, f"{query!r} reads no metric"
        assert names <= exported, (
            f"{query!r} reads {sorted(names - exported)}, which broker/core/metrics.py does not export"
        )
        seen |= names
    # Each thing the issue asks the dashboard to show is on it.
    for name in (
        "gpush_queue_jobs",
        "gpush_cluster_gpu_equivalents_allocated",
        "gpush_cluster_gpu_equivalents_free",
        "gpush_drift_findings",
        "gpush_scheduler_cycle_seconds_bucket",
        "gpush_adapter_call_seconds_bucket",
        "gpush_adapter_call_errors_total",
    ):
        assert name in seen, name
