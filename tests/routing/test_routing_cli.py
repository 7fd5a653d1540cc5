"""Admins and users at the command line: clusters, routing policy, tenants, and the scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "examples" / "fleet.yaml"
DEFAULT = ROOT / "policies" / "default.yaml"


@pytest.fixture
def fleet(gpush):
    for name in ("slurm-a", "k8s-a"):
        result = gpush("cluster", "add", name, "--kind", "sim", "--fleet", FLEET)
        assert result.code == 0, result.err
    return gpush


def test_cluster_add_and_list_show_health_and_capacity(fleet):
    listed = fleet("cluster", "list", "--json").json
    by_name = {c["name"]: c for c in listed}
    assert set(by_name) == {"k8s-a", "slurm-a"}
    slurm = by_name["slurm-a"]
    assert slurm["health"]["ok"] and slurm["nodes"] == 4
    assert set(slurm["capacity"]) == {"slurm/exclusive", "slurm/mig", "slurm/mps"}
    # 8 whole A100-80GB + 7/7 + 6/7 of MIG A100s + 2 MPS GPUs, all free.
    assert slurm["gpu_total"] == pytest.approx(8 + 1 + 6 / 7 + 2)
    table = fleet("cluster", "list").out
    assert "slurm-a" in table and "k8s/timeslice" in table


def test_cluster_add_refuses_what_cannot_work(gpush, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "clusters:\n  x:\n    flavor: slurm\n    nodes:\n      - {name: n, gpus: [{model: T4, mig: [1g.5gb]}]}\n"
    )
    result = gpush("cluster", "add", "x", "--kind", "sim", "--fleet", bad)
    assert result.code == 2 and "T4" in result.err and "MIG" in result.err
    unknown = gpush("cluster", "add", "prod", "--kind", "slurm", "--config", "url=http://slurm:6820")
    assert unknown.code == 2 and "unknown setting 'url': did you mean rest_url?" in unknown.err
    down = gpush("cluster", "add", "prod", "--kind", "slurm", "--config", "rest_url=http://127.0.0.1:9")
    assert down.code == 2 and "does not answer" in down.err
    assert gpush("cluster", "list", "--json").json == []
    again = gpush("cluster", "add", "Bad_Name", "--kind", "sim", "--fleet", bad)
    assert again.code == 2 and "name" in again.err


def test_policy_lifecycle_validate_apply_history_diff_rollback(fleet, tmp_path):
    assert fleet("policy", "validate", DEFAULT).code == 0
    applied = fleet("policy", "apply", DEFAULT, "-m", "first", "--json").json
    assert applied["version"] == 1 and applied["active"]
    edited = tmp_path / "edited.yaml"
    edited.write_text(
        DEFAULT.read_text().replace(
            "gpu_memory_gb: {max: 4}\n    route: {cluster: k8s-a", "gpu_memory_gb: {max: 3}\n    route: {cluster: k8s-a"
        )
    )
    assert fleet("policy", "apply", edited, "-m", "smaller time-slices").code == 0
    history = fleet("policy", "history", "--json").json
    assert [(v["version"], v["active"], v["comment"]) for v in history] == [
        (2, True, "smaller time-slices"),
        (1, False, "first"),
    ]
    diff = fleet("policy", "diff", 1, 2).out
    assert "-      gpu_memory_gb: {max: 4}" in diff and "+      gpu_memory_gb: {max: 3}" in diff
    rolled = fleet("policy", "rollback", 1, "-m", "too tight", "--json").json
    assert rolled["version"] == 3 and "rollback to version 1" in rolled["comment"]
    assert fleet("policy", "show").out == DEFAULT.read_text()


def test_a_refused_policy_leaves_the_active_one_in_place(fleet, tmp_path):
    fleet("policy", "apply", DEFAULT, "-m", "first")
    shadowed = tmp_path / "shadowed.yaml"
    shadowed.write_text(
        "rules:\n"
        "  - name: all-training\n    match: {kind: training}\n    route: {cluster: slurm-a, sharing: slurm/exclusive}\n"
        "  - name: big-training\n    match: {kind: training, gpus: {min: 4}}\n"
        "    route: {cluster: slurm-a, sharing: slurm/exclusive}\n"
    )
    result = fleet("policy", "apply", shadowed, "-m", "oops")
    assert result.code == 2
    assert "shadow" in result.err and "big-training" in result.err
    assert fleet("policy", "validate", shadowed).code == 2
    typo = tmp_path / "typo.yaml"
    typo.write_text("rules:\n  - name: a\n    match: {}\n    route: {cluster: slurm-a, sharing: slurm/mgi}\n")
    bad = fleet("policy", "apply", typo, "-m", "typo")
    assert bad.code == 2 and "line 4" in bad.err
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("rules:\n  - name: a\n    match: {}\n    route: {cluster: slurm-b, sharing: slurm/exclusive}\n")
    assert "slurm-b" in fleet("policy", "apply", unknown, "-m", "x").err
    assert [v["version"] for v in fleet("policy", "history", "--json").json] == [1]


def test_a_missing_file_is_named_for_what_it_is(gpush):
    for command in (("policy", "validate", "nofile.yaml"), ("policy", "apply", "nofile.yaml", "-m", "x")):
        result = gpush(*command)
        assert result.code == 2 and "gpush: error: policy file nofile.yaml does not exist" in result.err, command
    # explain -f reads a job file, not a policy.
    assert "job file nofile.yaml does not exist" in gpush("policy", "explain", "-f", "nofile.yaml").err
    fleet = gpush("cluster", "add", "x", "--kind", "sim", "--fleet", "nofile.yaml")
    assert fleet.code == 2 and "fleet file nofile.yaml does not exist" in fleet.err


def test_applying_the_active_policy_again_says_so_and_that_the_comment_was_not_recorded(fleet):
    fleet("policy", "apply", DEFAULT, "-m", "first")
    again = fleet("policy", "apply", DEFAULT, "-m", "tidy up")
    assert again.code == 0
    assert again.out.startswith("policy unchanged:") and "'tidy up' was not recorded" in again.out
    assert "is active (tidy up)" not in again.out
    assert fleet("policy", "apply", DEFAULT, "-m", "x", "--json").json["changed"] is False
    assert [v["comment"] for v in fleet("policy", "history", "--json").json] == ["first"]
    back = fleet("policy", "rollback", 1, "-m", "why not")
    assert back.code == 0 and back.out.startswith("policy unchanged: version 1 is active already")
    assert "'why not' was not recorded" in back.out


def test_explain_of_a_job_file_explains_each_of_its_jobs(fleet, tmp_path):
    fleet("policy", "apply", DEFAULT, "-m", "first")
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        "name: big\nkind: training\ngpus: 2\ncommand: [t]\n---\n"
        "kind: inference\ngpu_memory_gb: 4\nimage: serve:1\ncommand: [serve]\n"
    )
    explained = fleet("policy", "explain", "-f", jobs)
    assert explained.code == 0, explained.err
    first, second = explained.out.split("\n\n== ")
    assert first.startswith(f"== {jobs} job 1 of 2 (big)") and "route: slurm-a slurm/exclusive" in first
    assert second.startswith(f"{jobs} job 2 of 2") and "route: k8s-a k8s/timeslice" in second
    results = fleet("policy", "explain", "-f", jobs, "--json").json
    assert [r["routes"][0]["sharing"] for r in results] == ["slurm/exclusive", "k8s/timeslice"]


def test_only_admins_apply_policies_and_set_tenants(fleet):
    token = fleet("admin", "token", "create", "--user", "bob", "--tenant", "vision").out.strip()
    assert fleet("--token", token, "policy", "apply", DEFAULT, "-m", "x").code == 4
    assert fleet("--token", token, "tenant", "set", "vision", "--gpu-quota", "100").code == 4
    assert fleet("--token", token, "policy", "validate", DEFAULT).code == 0


def test_submit_schedule_and_see_where_jobs_went_and_why(fleet):
    fleet("policy", "apply", DEFAULT, "-m", "first")
    mig = fleet("submit", "--kind", "training", "--isolation", "hardware", "--gpu-memory-gb", "4", "--", "t").out
    big = fleet("submit", "--kind", "training", "--gpus", "16", "--", "t").out
    ran = fleet("scheduler", "run", "--cycles", "1")
    assert ran.code == 0 and "placed 1" in ran.out and "held 1" in ran.out
    placed = fleet("status", mig.strip(), "--json").json
    assert (placed["state"], placed["cluster"], placed["placement"]["mig_profile"]) == (
        "submitted",
        "slurm-a",
        "1g.5gb",
    )
    held = fleet("status", big.strip()).out
    assert "can never fit: needs 16 whole GPUs on one node" in held
    listing = fleet("list").out
    assert "slurm-a/mig-01 1g.5gb" in listing  # where it runs, in the WHERE/REASON column
    assert "slurm-a mig 1g.5gb mig-01" in fleet("list", "-o", "wide").out
    explained = fleet("policy", "explain", mig.strip()).out
    assert "1. isolated-training-on-mig: matched" in explained and "placement: slurm-a slurm/mig" in explained
    tenants = fleet("tenant", "list", "--json").json
    assert tenants[0]["gpu_used"] == pytest.approx(1 / 7)


def test_submit_says_at_once_when_a_job_can_never_run_and_still_exits_0(fleet, tmp_path):
    unpoliced = fleet("submit", "--kind", "training", "--gpus", "16", "--", "t")
    assert unpoliced.code == 0 and "can never run" not in unpoliced.err  # no policy yet: it may run later
    fleet("policy", "apply", DEFAULT, "-m", "first")

    big = fleet("submit", "--kind", "training", "--gpus", "16", "--", "t")
    said = " ".join(big.err.split())
    assert big.code == 0 and big.out.strip().isdigit()
    assert f"job {big.out.strip()} can never run as asked, so it is held: slurm-a slurm/exclusive: " in said
    assert "needs 16 whole GPUs on one node; no node of slurm-a has more than" in said
    assert f"gpush policy explain {big.out.strip()}" in said
    fits = fleet("submit", "--kind", "training", "--gpus", "1", "--", "t")
    assert fits.code == 0 and fits.err == ""

    narrow = tmp_path / "narrow.yaml"
    narrow.write_text(
        "rules:\n  - name: only-training\n    match: {kind: training}\n"
        "    route: {cluster: slurm-a, sharing: slurm/exclusive}\n"
    )
    fleet("policy", "apply", narrow, "-m", "training only")
    batch = fleet("submit", "--kind", "batch", "--", "t")
    assert batch.code == 0 and "can never run as asked" in batch.err and "no rule" in batch.err


def test_a_tenant_at_quota_waits_and_says_so(fleet):
    fleet("policy", "apply", DEFAULT, "-m", "first")
    assert fleet("tenant", "set", "default", "--gpu-quota", "1").code == 0
    first = fleet("submit", "--kind", "training", "--gpus", "1", "--", "a").out.strip()
    second = fleet("submit", "--kind", "training", "--gpus", "1", "--", "b").out.strip()
    fleet("scheduler", "run", "--cycles", "1")
    assert fleet("status", first, "--json").json["state"] == "submitted"
    waiting = fleet("status", second, "--json").json
    assert (waiting["state"], waiting["state_reason"]) == ("queued", "tenant default at quota (1/1 GPU)")
    fleet("tenant", "set", "default", "--no-quota")
    fleet("scheduler", "run", "--cycles", "1")
    assert fleet("status", second, "--json").json["state"] == "submitted"
