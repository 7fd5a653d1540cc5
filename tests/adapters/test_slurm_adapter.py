"""The Slurm adapter on Slurm's own answers, recorded on Slurm 22.05, 24.11 and 26.05
(tests/data/slurm/README.md says how and what each file is).

No Slurm runs here. ``RecordedSlurm`` is a client (the ``SlurmClient`` protocol) that
answers from those files and behaves as Slurm did when they were recorded; the REST
backend meets a slurmrestd made of recorded HTTP answers; the command-line backend runs
stand-in ``sbatch``/``squeue``/... scripts. Rendered batch scripts run for real.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.slurm import client as slurm_client
from adapters.slurm import logs as slurm_logs
from adapters.slurm import restarts as slurm_restarts
from adapters.slurm import status as slurm_status
from adapters.slurm.adapter import SlurmAdapter
from adapters.slurm.client import CliBackend, RestBackend, SlurmClient, read_jobcomp
from adapters.slurm.records import FINAL_STATES, FinishedRecord, Gres, SlurmJob, SlurmNode, Submission, parse_gres
from adapters.slurm.render import expand_filename, gres_for, render
from adapters.slurm.settings import SlurmSettings
from broker.core.adapter import (
    BackendState,
    ClusterAdapter,
    Placement,
    Rejected,
    Sharing,
    Unreachable,
)
from broker.core.errors import InvalidRequest
from broker.core.schemas import JobSpec

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm"
V2205 = DATA / "2205"
V2411 = DATA / "2411"  # Slurm 24.11.5 (Debian 13), data parser v0.0.42
V2605 = DATA / "2605"  # Slurm 26.05.5 (Debian sid), data parser v0.0.45
# The newer versions, recorded with the same jobs: ``squeue --json --states=all`` in
# squeue.json, ``scontrol --json show nodes`` in nodes*.json.
NEWER = [V2411, V2605]
RELEASE = {V2205: "22.05.8", V2411: "24.11.5", V2605: "26.05.5"}


def answer(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def raw_job(path: Path, name: str) -> dict[str, Any]:
    return next(raw for raw in answer(path)["jobs"] if raw["name"] == name)


def jobs_of(*paths: Path) -> list[SlurmJob]:
    return [SlurmJob.of(raw) for path in paths for raw in answer(path)["jobs"]]


def nodes_of(path: Path) -> list[SlurmNode]:
    return [SlurmNode.of(raw) for raw in answer(path)["nodes"]]


def by_name(jobs: list[SlurmJob]) -> dict[str, SlurmJob]:
    return {job.name: job for job in jobs}


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


# The Slurm user the answers were recorded as, and the one the broker runs as here: the
# adapter takes only jobs of the user it submits as for its own (adapters.slurm.context).
RECORDED_AS = "root"


class RecordedSlurm:
    """A Slurm that answers from recorded JSON and does what the real one did.

    It implements ``SlurmClient``: squeue lists every job it knows, finished ones too; a
    submission of a GRES no node has is refused *and* leaves a FAILED BadConstraints
    record (as sbatch does: integration/slurm/README.md, pitfall 7); finished jobs that left squeue come from a
    jobcomp/filetxt file, read by the real parser.
    """

    def __init__(
        self,
        jobs: list[SlurmJob],
        nodes: list[SlurmNode],
        *,
        version: str = "22.05.8",
        jobcomp: Path | None = None,
        lists_new_jobs: bool = True,
    ):
        self.job_list = list(jobs)
        self.node_list = list(nodes)
        self.release = version
        self.jobcomp = jobcomp
        self.lists_new_jobs = lists_new_jobs
        self.submitted: list[Submission] = []
        self.cancelled: list[str] = []
        self.next_id = 1000
        self._lock = threading.Lock()  # submit_many submits on several threads

    def version(self) -> str:
        return self.release

    def ping(self) -> str:
        return "UP"

    def submit(self, job: Submission) -> str:
        with self._lock:
            return self._submit(job)

    def _submit(self, job: Submission) -> str:
        self.submitted.append(job)
        self.next_id += 1
        job_id = str(self.next_id)
        if job.hold and not job.gres:  # a placeholder: takes nothing, never runs
            self.job_list.append(replace(self.job_list[0], job_id=job_id, name=job.name, states=("PENDING",)))
            return job_id
        wanted = parse_gres(job.gres)[0]
        offered = {(g.name, g.type) for node in self.node_list for g in node.gres}
        known = (wanted.name, wanted.type) in offered or (
            wanted.type is None and wanted.name in {n for n, _ in offered}
        )
        now = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
        record = SlurmJob(
            job_id=job_id,
            name=job.name,
            comment=job.comment,
            states=("PENDING",) if known else ("FAILED",),
            reason="None" if known else "BadConstraints",
            nodes="",
            partition=job.partition or "gpu",
            tres_per_node=(wanted,),
            gres_detail=(),
            exit_code=None,
            submit_time=now,
            start_time=None,
            end_time=None if known else now,
            user=job.user or RECORDED_AS,  # the user sbatch ran as: the broker's, or the job's own
            account=job.account or "",
        )
        if self.lists_new_jobs or not known:
            self.job_list.append(record)
        if not known:
            raise Rejected("Slurm refused the job: Requested node configuration is not available")
        return job_id

    def jobs(self) -> list[SlurmJob]:
        return list(self.job_list)

    def nodes(self) -> list[SlurmNode]:
        return list(self.node_list)

    def cancel(self, job_id: str) -> None:
        self.cancelled.append(job_id)
        self.job_list = [
            replace(j, states=("CANCELLED",)) if j.job_id == job_id and j.state not in FINAL_STATES else j
            for j in self.job_list
        ]

    def finished(self, since: datetime | None) -> list[FinishedRecord]:
        return read_jobcomp(self.jobcomp, since) if self.jobcomp else []

    topology_text = ""  # what scontrol show topology prints (tests set one)

    def network_topology(self) -> str:
        return self.topology_text


def recorded_2205(**kwargs: Any) -> RecordedSlurm:
    return RecordedSlurm(jobs_of(V2205 / "squeue.json"), nodes_of(V2205 / "sinfo.json"), **kwargs)


def recorded_newer(folder: Path, **kwargs: Any) -> RecordedSlurm:
    """The 24.11 or 26.05 cluster as recorded, all jobs live (gpu01 not drained yet)."""
    jobs = jobs_of(folder / "squeue.json")
    return RecordedSlurm(jobs, nodes_of(folder / "nodes.json"), version=RELEASE[folder], **kwargs)


WORKDIR = Path("/nonexistent")  # the running test's own directory (_workdir)
# Where the recorded jobs wrote their output (log_dir "log" of that cluster's directory):
# the adapter reads only in its own log directory.
RECORDED_LOG_DIR = {
    folder: {"workdir": f"/tmp/gpush-slurm-{name}", "log_dir": "log"}
    for folder, name in ((V2205, "ut"), (V2411, "2411"), (V2605, "2605"))
}


@pytest.fixture(autouse=True)
def _workdir(tmp_path, monkeypatch):
    """Jobs are submitted into the test's own directory: the adapter creates their log
    directory there before it submits (as it would on a shared filesystem)."""
    monkeypatch.setattr(f"{__name__}.WORKDIR", tmp_path)


def adapter(client: SlurmClient, name: str = "slurm-a", **config: Any) -> SlurmAdapter:
    return SlurmAdapter(name, {"cache_seconds": 0, "workdir": str(WORKDIR), **config}, client=client)


def jobcomp_line(
    job_id: int,
    name: str,
    state: str,
    end: datetime,
    exit_code: str = "0:0",
    node: str = "mig01",
    started: datetime | None = None,
) -> str:
    """One jobcomp/filetxt line in the shape of tests/data/slurm/2205/jobcomp.txt.
    Slurm writes local time without a zone, so this does too."""
    local = end.astimezone().strftime("%Y-%m-%dT%H:%M:%S")
    start = (started or end - timedelta(seconds=60)).astimezone().strftime("%Y-%m-%dT%H:%M:%S")
    return (
        f"JobId={job_id} UserId=root(0) GroupId=root(0) Name={name} JobState={state} Partition=gpu "
        f"TimeLimit=525600 StartTime={start} EndTime={local} NodeList={node} NodeCnt=1 ProcCnt=1 "
        f"WorkDir=/tmp ReservationName= Tres=cpu=1,mem=1000M,node=1,billing=1 Account= QOS= WcKey= "
        f"Cluster=unknown SubmitTime={start} EligibleTime={start} DerivedExitCode=0:0 ExitCode={exit_code} \n"
    )


def spec(command: list[str] | None = None, **fields: Any) -> JobSpec:
    fields.setdefault("tenant", "ml")
    fields.setdefault("user", "alice")
    return JobSpec(kind="batch", command=command or ["python", "train.py"], **fields)


def mig(profile: str = "1g.5gb", units: int = 1) -> Placement:
    return Placement("slurm-a", Sharing.SLURM_MIG, units, units * 1 / 7, node="mig01", mig_profile=profile)


def mps(percent: int = 25) -> Placement:
    return Placement("slurm-a", Sharing.SLURM_MPS, percent, percent / 100, node="mps01", gpu_model="A100-SXM4-40GB")


def whole(gpus: int = 1, model: str | None = "A100-SXM4-40GB", node: str | None = "gpu01") -> Placement:
    return Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, gpus, float(gpus), node=node, gpu_model=model)


# -- Slurm's answers read into records --------------------------------------------------


def test_parse_gres_reads_every_spelling_slurm_uses():
    assert parse_gres("gpu:1g.5gb:7,gpu:3g.20gb:2,mps:100") == [
        Gres("gpu", "1g.5gb", 7),
        Gres("gpu", "3g.20gb", 2),
        Gres("mps", None, 100),
    ]
    # what a node uses, with device indexes (commas inside the parentheses stay put)
    assert parse_gres("gpu:1g.5gb:3(IDX:0,2,4),gpu:3g.20gb:0(IDX:N/A),mps:0") == [
        Gres("gpu", "1g.5gb", 3),
        Gres("gpu", "3g.20gb", 0),
        Gres("mps", None, 0),
    ]
    # what a job asked for: 22.05's tres_per_node, the TRES form, newer squeue, socket suffix
    assert parse_gres("gres:gpu:3g.20gb:1") == [Gres("gpu", "3g.20gb", 1)]
    assert parse_gres("gres/gpu:1g.5gb=1") == [Gres("gpu", "1g.5gb", 1)]
    assert parse_gres("gres/mps:25") == [Gres("mps", None, 25)]
    assert parse_gres("gpu:a100:2(S:0-1)") == [Gres("gpu", "a100", 2)]
    assert parse_gres(["gpu:3g.20gb:1(IDX:7)"]) == [Gres("gpu", "3g.20gb", 1)]
    assert parse_gres("gpu") == [Gres("gpu", None, 1)]
    for nothing in ("", "(null)", None, []):
        assert parse_gres(nothing) == []


def test_jobs_recorded_on_2205_read_as_slurm_meant_them():
    jobs = by_name(jobs_of(V2205 / "squeue.json"))

    done = jobs["gpush-1"]
    assert (done.job_id, done.state, done.exit_code, done.nodes) == ("1", "COMPLETED", 0, "gpu01")
    assert done.tres_per_node == (Gres("gpu", "a100", 1),)
    assert done.comment == "gpush:job-1 tenant=ml user=alice"
    assert done.end_time == utc("2026-12-03T09:22:56") and done.last_change == done.end_time

    failed = jobs["gpush-2"]
    # squeue --json gives the wait status 768; the program exited 3, as ExitCode=3:0 says
    assert (failed.state, failed.reason, failed.exit_code) == ("FAILED", "NonZeroExitCode", 3)

    running = jobs["gpush-7"]
    assert running.states == ("RUNNING",) and running.reason == "None"
    assert running.tres_per_node == (Gres("gpu", "1g.5gb", 1),)
    assert running.gres_detail == ("gpu:1g.5gb:1(IDX:0)",)
    assert running.start_time == utc("2026-12-03T09:23:02")
    # a running job's end_time is its time limit, not a change
    assert running.end_time > running.start_time and running.last_change == running.start_time

    assert jobs["gpush-10"].tres_per_node == (Gres("mps", None, 25),)
    refused = jobs["gpush-11"]
    assert (refused.state, refused.reason, refused.nodes) == ("FAILED", "BadConstraints", "")
    pending = jobs["gpush-8"]
    assert (pending.state, pending.reason) == ("PENDING", "Resources")
    # a pending job's start_time is Slurm's estimate (here: when the running jobs' time
    # limits run out, a year on), not a change
    assert pending.start_time == utc("2027-12-03T09:23:02")
    assert pending.last_change == pending.submit_time == utc("2026-12-03T09:23:03")
    assert jobs["gpush-14"].state == "CANCELLED"


# When the newer clusters started gpush-7 (it ran on, a year's time limit) and when
# gpush-8, pending, was submitted.
STARTED = {V2411: utc("2026-12-06T03:30:45"), V2605: utc("2026-12-06T03:33:22")}
QUEUED = {V2411: utc("2026-12-06T03:30:46"), V2605: utc("2026-12-06T03:33:22")}


@pytest.mark.parametrize("folder", NEWER)
def test_jobs_recorded_on_24_11_and_26_05_read_as_slurm_meant_them(folder):
    jobs = by_name(jobs_of(folder / "squeue.json"))
    raw = {j["name"]: j for j in answer(folder / "squeue.json")["jobs"]}
    # the shapes the parser reads: lists of states, {"set", "number"} times, an exit code object
    assert raw["gpush-7"]["job_state"] == ["RUNNING"]
    assert raw["gpush-7"]["start_time"] == {"set": True, "infinite": False, "number": STARTED[folder].timestamp()}
    signal = raw["gpush-3"]["exit_code"]["signal"]
    assert signal == {"id": {"set": True, "infinite": False, "number": 9}, "name": "KILL"}

    running = jobs["gpush-7"]
    assert (running.job_id, running.states, running.nodes, running.reason) == ("4", ("RUNNING",), "mig01", "None")
    # asked as gres/gpu:1g.5gb:1 (22.05: gres:gpu:1g.5gb:1), given with its index
    assert running.tres_per_node == (Gres("gpu", "1g.5gb", 1),)
    assert running.gres_detail == ("gpu:1g.5gb:1(IDX:0)",)
    assert running.start_time == STARTED[folder] and running.last_change == running.start_time
    assert running.end_time > running.start_time  # its time limit, not a change
    assert running.comment == "gpush:job-7 tenant=ml user=alice"
    assert jobs["gpush-10"].tres_per_node == (Gres("mps", None, 25),)
    assert jobs["gpush-10"].gres_detail == ("mps:25(25/100)",)

    pending = jobs["gpush-8"]
    # Slurm's estimate of its start (when the running jobs' time limits run out, a year
    # on), not a change
    assert (pending.state, pending.reason) == ("PENDING", "Resources")
    assert pending.start_time == STARTED[folder] + timedelta(days=365)
    assert pending.last_change == pending.submit_time == QUEUED[folder]
    # a job waiting on a drained node has no estimate: {"set": true, "number": 0} is "not
    # yet", not the epoch
    behind = by_name(jobs_of(folder / "squeue_drain.json"))["gpush-13"]
    assert (behind.state, behind.reason, behind.start_time, behind.end_time) == ("PENDING", "Resources", None, None)
    assert behind.description.startswith("Nodes required for job are DOWN, DRAINED")

    assert (jobs["gpush-1"].state, jobs["gpush-1"].exit_code, jobs["gpush-1"].nodes) == ("COMPLETED", 0, "gpu01")
    failed = jobs["gpush-2"]
    assert (failed.state, failed.reason, failed.exit_code) == ("FAILED", "NonZeroExitCode", 3)
    # {"status": ["SIGNALED"], "signal": {"id": 9, "name": "KILL"}} reads as a shell would
    assert (jobs["gpush-3"].state, jobs["gpush-3"].reason, jobs["gpush-3"].exit_code) == ("FAILED", "RaisedSignal", 137)
    refused = jobs["gpush-11"]
    assert (refused.state, refused.reason, refused.nodes) == ("FAILED", "BadConstraints", "")
    assert (jobs["gpush-14"].state, jobs["gpush-14"].nodes) == ("CANCELLED", "")


def test_comment_reads_from_a_string_and_from_24_11_accounting_objects():
    raw = raw_job(V2411 / "squeue.json", "gpush-7")
    as_object = dict(raw, comment={"administrator": "", "job": raw["comment"], "system": "requeued"})
    assert SlurmJob.of(as_object).comment == SlurmJob.of(raw).comment == "gpush:job-7 tenant=ml user=alice"
    # sacct's comment is that object; slurmdbd kept no job comment here (it stores one
    # only with AccountingStoreFlags=job_comment)
    recorded = answer(V2411 / "sacct.json")["jobs"][0]["comment"]
    assert recorded == {"administrator": "", "job": "", "system": ""}
    assert SlurmJob.of(dict(raw, comment=recorded)).comment == ""


@pytest.mark.parametrize("version", [V2205, *NEWER])
def test_nodes_read_state_gres_and_partitions(version):
    path = version / ("sinfo.json" if version == V2205 else "nodes.json")
    nodes = {node.name: node for node in nodes_of(path)}
    assert set(nodes) == {"mig01", "mps01", "gpu01"}
    assert nodes["mig01"].gres == (Gres("gpu", "1g.5gb", 7), Gres("gpu", "3g.20gb", 2))
    assert Gres("gpu", "1g.5gb", 7) in nodes["mig01"].gres_used
    assert nodes["mps01"].gres == (Gres("gpu", "a100", 1), Gres("mps", "a100", 100))
    assert nodes["gpu01"].gres == (Gres("gpu", "a100", 2),)
    assert (nodes["mig01"].cpus, nodes["mig01"].memory_mb) == (16, 64000)
    assert nodes["mig01"].partitions == ("gpu", "mig")
    assert nodes["mig01"].unavailable is None
    if version != V2205:
        # MPS in use shows in gres_used from 24.11 on (22.05: mps:a100:1(IDX:0) whatever the share)
        assert nodes["mps01"].gres_used == (Gres("gpu", "a100", 0), Gres("mps", "a100", 25))


def test_a_drained_or_down_node_says_why_it_takes_nothing():
    drained = {n.name: n for n in nodes_of(V2205 / "sinfo_drain.json")}["gpu01"]
    assert drained.states == ("MIXED", "DRAIN")  # 22.05: "mixed" plus state_flags ["DRAIN"]
    assert drained.unavailable == "node gpu01 is drain: gpu 1 fell off the bus"

    down = {n.name: n for n in nodes_of(V2205 / "sinfo_down.json")}
    assert down["mps01"].unavailable == "node mps01 is down: nvidia-smi: no devices found"
    assert down["gpu01"].states == ("IDLE", "DRAIN") and down["gpu01"].unavailable


@pytest.mark.parametrize("folder", NEWER)
def test_a_drained_or_down_node_says_why_it_takes_nothing_on_24_11_and_26_05(folder):
    drained = {n.name: n for n in nodes_of(folder / "nodes_drain.json")}["gpu01"]
    assert drained.states == ("MIXED", "DRAIN")  # "state": ["MIXED", "DRAIN"], no state_flags
    assert drained.unavailable == "node gpu01 is drain: gpu 1 fell off the bus"

    down = {n.name: n for n in nodes_of(folder / "nodes_down.json")}
    assert down["mps01"].states == ("DOWN",)
    assert down["mps01"].unavailable == "node mps01 is down: nvidia-smi: no devices found"
    assert down["gpu01"].states == ("IDLE", "DRAIN") and down["gpu01"].unavailable


def test_the_recorded_jobcomp_log_reads_into_finished_records():
    records = {r.name: r for r in read_jobcomp(V2205 / "jobcomp.txt", None)}
    assert (records["gpush-1"].job_id, records["gpush-1"].state, records["gpush-1"].exit_code) == ("1", "COMPLETED", 0)
    assert (records["gpush-2"].state, records["gpush-2"].exit_code, records["gpush-2"].nodes) == ("FAILED", 3, "gpu01")
    assert records["gpush-14"].state == "CANCELLED"
    assert records["gpush-7"].end_time is not None
    assert read_jobcomp(V2205 / "no-such-file.txt", None) == []


# -- rendering: a job as a batch script and sbatch options -----------------------------

NASTY = [
    "it's",
    'say "hi"',
    "$(touch {pwned}/dollar)",
    "`touch {pwned}/backquote`",
    "; touch {pwned}/semicolon",
    "line one\nline two",
    "naïve ☃ 日本語",
    "",
    "-n",
    "--",
    "\\ * ? ~ $HOME ${PATH} %s",
    "' ; echo escaped '",
]


def run_script(script: str, tmp_path: Path) -> bytes:
    path = tmp_path / "job.sh"
    path.write_text(script)
    done = subprocess.run(["/bin/sh", str(path)], capture_output=True, env={}, timeout=10, check=True)
    return done.stdout


def test_the_script_hands_every_argument_to_the_program_byte_for_byte(tmp_path):
    argv = [arg.replace("{pwned}", str(tmp_path)) for arg in NASTY]
    job = render(7, spec(["printf", "%s\\n", *argv]), mig(), tag="gpush", gres_type=None)

    out = run_script(job.script, tmp_path)

    assert out == "".join(f"{arg}\n" for arg in argv).encode()
    assert not [p.name for p in tmp_path.iterdir() if p.name != "job.sh"]  # nothing ran


def test_the_script_exports_every_value_byte_for_byte(tmp_path):
    values = [arg.replace("{pwned}", str(tmp_path)) for arg in NASTY]
    env = {f"NASTY_{i}": value for i, value in enumerate(values)}
    job = render(7, spec(["/usr/bin/env", "-0"], env=env), mig(), tag="gpush", gres_type=None)

    out = run_script(job.script, tmp_path)

    seen = dict(item.split("=", 1) for item in out.decode().split("\0") if item)
    assert {k: seen.get(k) for k in env} == env
    assert seen["GPUSH_JOB_ID"] == "7" and seen["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert not [p.name for p in tmp_path.iterdir() if p.name != "job.sh"]


def test_the_job_cannot_override_gpush_variables_but_sets_its_own_path(tmp_path):
    job = render(
        7,
        spec(["/usr/bin/env", "-0"], env={"GPUSH_JOB_ID": "999", "PATH": "/opt/bin:/usr/bin"}),
        mig(),
        tag="gpush",
        gres_type=None,
    )
    seen = dict(item.split("=", 1) for item in run_script(job.script, tmp_path).decode().split("\0") if item)
    assert seen["GPUSH_JOB_ID"] == "7"
    assert seen["PATH"] == "/opt/bin:/usr/bin"


@pytest.mark.parametrize(
    ("placement", "gres"),
    [
        (mig("1g.5gb"), "gpu:1g.5gb:1"),
        (mig("3g.20gb", 2), "gpu:3g.20gb:2"),
        (mps(25), "mps:25"),
        (whole(2), "gpu:a100:2"),
    ],
)
def test_every_sharing_mode_asks_for_typed_gres(placement, gres):
    job = render(7, spec(gpu_memory_gb=5), placement, tag="gpush", gres_type="a100")
    assert job.gres == gres
    args = job.sbatch_args()
    assert f"--gres={gres}" in args
    assert "--export=ALL" in args
    assert not [a for a in args if re.fullmatch(r"--gres=gpu:\d+", a)]


@pytest.mark.parametrize(
    ("percent", "mps_per_gpu", "gres"),
    [(25, 100, "mps:25"), (25, 400, "mps:100"), (33, 1000, "mps:330"), (1, 10, "mps:1"), (100, 100, "mps:100")],
)
def test_mps_shares_are_sized_in_the_nodes_own_units(percent, mps_per_gpu, gres):
    assert gres_for(mps(percent), gres_type=None, mps_per_gpu=mps_per_gpu) == gres


def test_gres_that_cannot_be_typed_is_refused_not_sent_untyped():
    with pytest.raises(Rejected, match="no GRES type of this cluster is known for GPU model A100-SXM4-40GB"):
        gres_for(whole(1), gres_type=None, mps_per_gpu=100)
    with pytest.raises(Rejected, match="without a MIG profile"):
        gres_for(Placement("slurm-a", Sharing.SLURM_MIG, 1, 1 / 7), gres_type=None, mps_per_gpu=100)
    with pytest.raises(Rejected, match="k8s/timeslice is not a Slurm sharing mode"):
        gres_for(Placement("k8s-a", Sharing.K8S_TIMESLICE, 1, 0.25), gres_type="a100", mps_per_gpu=100)


def test_render_tags_the_job_and_translates_its_limits():
    job = render(
        42,
        spec(name="bert", memory="16G", time_limit="1h30m", cpus=4),
        whole(1),
        tag="gpush",
        gres_type="a100",
        partition="exclusive",
        account="ml",
        workdir="/scratch/gpush/",
    )
    assert job.name == "gpush-42"
    assert job.comment == "gpush:job-42 tenant=ml user=alice name=bert"
    assert job.sbatch_args() == [
        "--parsable",
        "--job-name=gpush-42",
        "--comment=gpush:job-42 tenant=ml user=alice name=bert",
        "--gres=gpu:a100:1",
        "--cpus-per-task=4",
        "--chdir=/scratch/gpush/",
        "--output=/scratch/gpush/gpush-logs/gpush-42.out",
        "--error=/scratch/gpush/gpush-logs/gpush-42.err",
        "--export=ALL",
        "--nodelist=gpu01",  # the node gpush placed it on
        "--mem=16384M",
        "--time=90",
        "--partition=exclusive",
        "--account=ml",
    ]


def test_the_gpu_memory_budget_is_the_share_of_the_gpu_under_mps():
    job = render(7, spec(isolation="process", gpu_memory_gb=8), mps(25), tag="gpush", gres_type=None, gpu_memory_gb=40)
    assert job.environment["GPUSH_GPU_MEMORY_FRACTION"] == "0.2"
    assert job.environment["GPUSH_GPU_MEMORY_GB"] == "8"
    slice_job = render(8, spec(), mig(), tag="gpush", gres_type=None, gpu_memory_gb=5)
    assert slice_job.environment["GPUSH_GPU_MEMORY_FRACTION"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in slice_job.environment


def test_render_refuses_what_slurm_cannot_run():
    with pytest.raises(Rejected, match="Slurm runs a command"):
        render(7, JobSpec(kind="batch", image="pytorch:2"), mig(), tag="gpush", gres_type=None)
    replicas = Placement("slurm-a", Sharing.SLURM_MPS, 25, 0.5, replicas=2)
    with pytest.raises(Rejected, match="one replica per job"):
        render(7, spec(), replicas, tag="gpush", gres_type=None)


# -- the adapter on the recorded cluster -------------------------------------------------


def test_the_adapter_is_a_cluster_adapter():
    assert isinstance(adapter(recorded_2205()), ClusterAdapter)


def test_inventory_of_the_recorded_cluster():
    units = {(u.node, u.sharing, u.mig_profile): u for u in adapter(recorded_2205()).inventory()}

    small = units[("mig01", Sharing.SLURM_MIG, "1g.5gb")]
    assert (small.capacity, small.allocated, small.free) == (7, 7, 0)  # gpush-7 and filler hold all 7
    assert small.gpu_equivalent == pytest.approx(1 / 7)
    assert (small.gpu_model, small.unit_memory_gb, small.in_mig_mode) == ("A100-SXM4-40GB", 5.0, True)

    large = units[("mig01", Sharing.SLURM_MIG, "3g.20gb")]
    assert (large.capacity, large.allocated, large.gpu_equivalent) == (2, 1, pytest.approx(3 / 7))
    assert large.unit_memory_gb == 20.0

    share = units[("mps01", Sharing.SLURM_MPS, None)]
    # GresUsed says mps:a100:1 on 22.05; the running job asked for mps:25
    assert (share.capacity, share.allocated, share.gpu_equivalent) == (100, 25, 0.01)
    assert share.gpu_model == "A100-SXM4-40GB"
    # the GPU behind MPS is not also offered whole
    assert ("mps01", Sharing.SLURM_EXCLUSIVE, None) not in units

    gpus = units[("gpu01", Sharing.SLURM_EXCLUSIVE, None)]
    assert (gpus.capacity, gpus.gpu_equivalent, gpus.gpu_model, gpus.unit_memory_gb) == (2, 1.0, "A100-SXM4-40GB", 40.0)
    assert gpus.labels["gres"] == "gpu:a100:2" and gpus.labels["partitions"] == "gpu,exclusive"
    assert len(units) == 4


@pytest.mark.parametrize("folder", NEWER)
def test_inventory_of_the_24_11_and_26_05_clusters_matches_and_a_drained_or_down_node_offers_nothing(folder):
    units = {(u.node, u.sharing, u.mig_profile): u for u in adapter(recorded_newer(folder)).inventory()}
    small = units[("mig01", Sharing.SLURM_MIG, "1g.5gb")]
    assert (small.capacity, small.allocated, small.free) == (7, 7, 0)  # gpush-7 and filler hold all 7
    assert units[("mig01", Sharing.SLURM_MIG, "3g.20gb")].free == 1
    # counted from the running jobs' mps:25, as on 22.05 (24.11's gres_used says the same)
    share = units[("mps01", Sharing.SLURM_MPS, None)]
    assert (share.capacity, share.allocated) == (100, 25)
    assert ("mps01", Sharing.SLURM_EXCLUSIVE, None) not in units
    gpus = units[("gpu01", Sharing.SLURM_EXCLUSIVE, None)]
    assert (gpus.capacity, gpus.free, gpus.gpu_model) == (2, 0, "A100-SXM4-40GB")  # gpush-12 holds both
    assert "unavailable" not in gpus.labels and len(units) == 4

    drain = RecordedSlurm(jobs_of(folder / "squeue.json"), nodes_of(folder / "nodes_drain.json"))
    drained = {(u.node, u.sharing): u for u in adapter(drain).inventory()}[("gpu01", Sharing.SLURM_EXCLUSIVE)]
    assert (drained.capacity, drained.free) == (2, 0)
    assert drained.labels["unavailable"] == "node gpu01 is drain: gpu 1 fell off the bus"

    # gpush-7 and gpush-10 done, gpush-8 on the freed slice, gpush-12 cancelled: gpu01 is
    # idle but drained, mps01 down
    down = RecordedSlurm(jobs_of(folder / "squeue_later.json"), nodes_of(folder / "nodes_down.json"))
    units = {(u.node, u.mig_profile or u.sharing.value): u for u in adapter(down).inventory()}
    assert units[("mps01", "slurm/mps")].free == 0
    assert units[("mps01", "slurm/mps")].labels["unavailable"] == "node mps01 is down: nvidia-smi: no devices found"
    assert units[("gpu01", "slurm/exclusive")].free == 0
    assert (units[("mig01", "1g.5gb")].free, units[("mig01", "3g.20gb")].free) == (0, 1)


def test_a_drained_or_down_node_offers_nothing_free():
    drain = RecordedSlurm(jobs_of(V2205 / "squeue.json"), nodes_of(V2205 / "sinfo_drain.json"))
    units = {(u.node, u.mig_profile or u.sharing.value): u for u in adapter(drain).inventory()}
    assert units[("gpu01", "slurm/exclusive")].free == 0
    assert units[("mps01", "slurm/mps")].free == 75
    assert units[("mig01", "3g.20gb")].free == 1

    down = RecordedSlurm(jobs_of(V2205 / "squeue_later.json"), nodes_of(V2205 / "sinfo_down.json"))
    units = {(u.node, u.mig_profile or u.sharing.value): u for u in adapter(down).inventory()}
    assert units[("mps01", "slurm/mps")].free == 0
    assert units[("mps01", "slurm/mps")].labels["unavailable"] == "node mps01 is down: nvidia-smi: no devices found"
    assert units[("gpu01", "slurm/exclusive")].free == 0  # idle, but drained
    assert (units[("mig01", "1g.5gb")].free, units[("mig01", "3g.20gb")].free) == (6, 2)


def test_gpu_types_name_the_model_behind_a_gres_type():
    settings = SlurmSettings.model_validate({"gpu_types": "a100=A100-SXM4-80GB, 1g.10gb=H100"})
    assert settings.gpu_types == {"a100": "A100-SXM4-80GB", "1g.10gb": "H100-SXM5-80GB"}

    slurm = adapter(recorded_2205(), gpu_types="a100=A100-SXM4-80GB,1g.10gb=H100")
    assert slurm.model_of("1g.10gb").name == "H100-SXM5-80GB"
    assert slurm.model_of("1g.5gb").name == "A100-SXM4-40GB"  # a MIG profile only the A100-40GB has
    assert slurm.model_of("weird") is None
    gpus = [u for u in slurm.inventory() if u.node == "gpu01"][0]
    assert (gpus.gpu_model, gpus.unit_memory_gb) == ("A100-SXM4-80GB", 80.0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"url": "http://slurm:6820"}, "unknown setting 'url': did you mean rest_url?"),
        ({"tokn_env": "SLURM_JWT"}, "unknown setting 'tokn_env': did you mean token_env?"),
        ({"gpu_types": "a100"}, "gpu_types is TYPE=MODEL"),
        ({"gpu_types": "a100=Z9000"}, "unknown GPU model 'Z9000'"),
        ({"mps_per_gpu": 0}, "mps_per_gpu: Input should be greater than or equal to 1"),
    ],
)
def test_settings_errors_name_the_setting_and_the_fix(config, message):
    with pytest.raises(InvalidRequest) as raised:
        SlurmAdapter("slurm-a", config, client=recorded_2205())
    assert str(raised.value).startswith("Slurm cluster slurm-a: ")
    assert message in str(raised.value)


def test_health_names_the_version_and_the_nodes_that_take_nothing():
    ok = adapter(recorded_2205()).health()
    assert ok.ok and ok.version == "22.05.8"
    assert ok.detail == "Slurm 22.05.8: 3 nodes, 12 GPU GRES"

    down = adapter(RecordedSlurm([], nodes_of(V2205 / "sinfo_down.json"))).health()
    assert down.ok and "2 unavailable" in down.detail
    assert "node mps01 is down: nvidia-smi: no devices found" in down.detail

    class Silent(RecordedSlurm):
        def ping(self) -> str:
            raise Unreachable("slurmctld is not up")

    silent = adapter(Silent([], [])).health()
    assert not silent.ok and "slurm-a does not answer: slurmctld is not up" in silent.detail


# -- statuses ---------------------------------------------------------------------------


def report(page) -> dict[int, tuple[BackendState, str | None]]:
    return {job.job_id: (job.state, job.reason) for job in page.jobs}


def test_statuses_without_a_cursor_report_every_gpush_job_in_user_terms():
    page = adapter(recorded_2205()).statuses()
    states = {job.job_id: job for job in page.jobs}

    assert set(states) == {1, 2, 7, 8, 9, 10, 11, 14}  # not the filler job
    assert (states[1].state, states[1].exit_code, states[1].backend_id) == (BackendState.SUCCEEDED, 0, "1")
    assert (states[2].state, states[2].exit_code, states[2].reason) == (BackendState.FAILED, 3, "exited with code 3")
    assert (states[7].state, states[7].node, states[7].at) == (
        BackendState.RUNNING,
        "mig01",
        utc("2026-12-03T09:23:02"),
    )
    assert states[8].state == BackendState.PENDING
    assert states[8].reason == "waiting in slurm-a for a 1g.5gb slice: all 7 busy"
    assert states[11].state == BackendState.FAILED
    assert states[11].reason == "Slurm refused it at submission: no node offers what it asks for"
    assert (states[14].state, states[14].reason) == (BackendState.CANCELLED, "cancelled in Slurm")
    # the cursor is Slurm's own time of the last change seen: gpush-14's cancellation
    assert page.cursor == f"t={int(utc('2026-12-03T09:23:13').timestamp())}"


def test_a_second_read_with_nothing_changed_reports_nothing():
    slurm = adapter(recorded_2205())
    first = slurm.statuses()
    again = slurm.statuses(first.cursor)
    assert again.jobs == [] and again.cursor == first.cursor


def test_a_rerun_that_squeue_first_lists_ended_as_its_previous_run_did_is_reported():
    """A preempted job queued again runs as a new Slurm job; when that rerun is quick, the next
    read may find it COMPLETED already, as the previous run ended. It is a new run all the
    same: the broker hears of it (before, it stayed ``submitted`` for good: a CI flake of the
    preemption test on the real 22.05 cluster)."""
    slurm = recorded_2205()
    gpush = adapter(slurm)
    first = gpush.statuses()
    previous = by_name(slurm.job_list)["gpush-1"]
    assert (report(first)[1][0], previous.state) == (BackendState.SUCCEEDED, "COMPLETED")
    slurm.job_list = [*slurm.job_list, dataclasses.replace(previous, job_id="99")]

    (rerun,) = gpush.statuses(first.cursor).jobs
    assert (rerun.job_id, rerun.backend_id, rerun.state) == (1, "99", BackendState.SUCCEEDED)
    assert gpush.statuses(first.cursor).jobs == []  # told once


def test_after_a_restart_the_cursor_reports_changes_after_it_and_not_before():
    cursor = f"t={int(utc('2026-12-03T09:23:00').timestamp())}"
    page = adapter(recorded_2205()).statuses(cursor)
    # gpush-1 and gpush-2 ended at 09:22:56, before the cursor; the rest changed after it
    assert set(report(page)) == {7, 8, 9, 10, 11, 14}


def test_jobs_that_change_are_reported_once_and_those_that_left_squeue_from_the_log(tmp_path):
    jobcomp = tmp_path / "jobcomp.txt"
    jobcomp.write_text(jobcomp_line(5, "gpush-9", "COMPLETED", utc("2026-12-03T09:25:02")))
    slurm = recorded_2205(jobcomp=jobcomp)
    gpush = adapter(slurm, jobcomp_file=str(jobcomp))
    first = gpush.statuses()

    # Two minutes later: gpush-7 and gpush-10 completed, gpush-8 got the freed slice,
    # gpush-9 completed and already left squeue (MinJobAge), only the log has it.
    slurm.job_list = jobs_of(V2205 / "squeue_later.json")
    later = gpush.statuses(first.cursor)

    assert report(later) == {
        7: (BackendState.SUCCEEDED, None),
        8: (BackendState.RUNNING, None),
        10: (BackendState.SUCCEEDED, None),
        9: (BackendState.SUCCEEDED, None),
    }
    from_log = [job for job in later.jobs if job.job_id == 9][0]
    assert (from_log.backend_id, from_log.at, from_log.node) == ("5", utc("2026-12-03T09:25:02"), "mig01")
    assert later.cursor == f"t={int(utc('2026-12-03T09:25:02').timestamp())}"
    assert gpush.statuses(later.cursor).jobs == []


def test_a_running_job_gone_sooner_than_min_job_age_was_lost_by_slurmctld_and_runs_again():
    # slurmctld keeps an ended job in squeue for MinJobAge (300 s by default): gpush-9,
    # running a moment ago and gone with no record, was lost by a crashed controller.
    slurm = recorded_2205()
    gpush = adapter(slurm)
    first = gpush.statuses()
    slurm.job_list = [job for job in slurm.job_list if job.name != "gpush-9"]

    page = gpush.statuses(first.cursor)

    assert report(page) == {
        9: (
            BackendState.LOST,
            "slurm-a lost the job while it ran (slurmctld restarted without it and ended its processes); "
            "it runs again from the start",
        )
    }


def test_after_slurmctld_lost_jobs_the_ids_it_gives_out_again_are_skipped_first():
    # A restarted slurmctld gives a lost job's id out again, and the node that ran it
    # refuses a new job with that id ("already running, do not launch second copy"):
    # Slurm requeues the new job held and drains the node (seen on the test cluster). So
    # the first submission after a loss moves Slurm's ids past the lost ones with held
    # placeholders, cancelled once every node has registered (here: at once).
    slurm = recorded_2205()
    gpush = adapter(slurm)
    first = gpush.statuses()
    assert by_name(slurm.job_list)["gpush-9"].job_id == "5"
    slurm.job_list = [job for job in slurm.job_list if job.name != "gpush-9"]
    assert report(gpush.statuses(first.cursor))[9][0] == BackendState.LOST
    slurm.next_id = 2  # the restarted slurmctld counts on from its saved state: 3, 4, 5 again

    assert gpush.submit(9, spec(), mig()) == "6"

    skipped = slurm.submitted[:-1]
    assert [(s.name, s.hold, s.gres) for s in skipped] == [("gpush-skip", True, "")] * 3
    assert "--hold" in skipped[0].sbatch_args() and not any(a.startswith("--gres") for a in skipped[0].sbatch_args())
    assert slurm.cancelled == ["3", "4", "5"]
    assert slurm.submitted[-1].name == "gpush-9" and not slurm.submitted[-1].hold
    # past them, submissions go straight to Slurm
    gpush.submit(20, spec(), mig())
    assert [s.name for s in slurm.submitted[-1:]] == ["gpush-20"] and slurm.cancelled == ["3", "4", "5"]


def lose_gpush_9(slurm: RecordedSlurm, gpush: SlurmAdapter) -> None:
    """slurmctld restarts without gpush-9 (Slurm job 5) and counts its ids on from 2."""
    first = gpush.statuses()
    slurm.job_list = [job for job in slurm.job_list if job.name != "gpush-9"]
    assert report(gpush.statuses(first.cursor))[9][0] == BackendState.LOST
    slurm.next_id = 2


def test_the_placeholders_stay_held_until_every_node_registered_with_the_restarted_controller(monkeypatch):
    # A node that reports a lost run's id while a pending job holds it has the run aborted;
    # one that reports it just after that job ended lets it run on beside its rerun (seen on
    # 22.05 with placeholders cancelled before the nodes registered: 7 of 7 ran twice).
    slurm = recorded_2205()
    gpush = adapter(slurm)
    lose_gpush_9(slurm, gpush)
    registered = slurm.node_list
    slurm.node_list = [replace(n, states=("UNKNOWN",)) for n in registered]  # right after the restart

    gpush.submit(9, spec(), mig())
    gpush.statuses()

    assert [s.name for s in slurm.submitted] == ["gpush-skip"] * 3 + ["gpush-9"] and slurm.cancelled == []
    slurm.node_list = registered
    gpush.statuses()
    assert slurm.cancelled == ["3", "4", "5"]


def test_placeholders_a_node_never_registers_for_are_cancelled_after_a_while(monkeypatch):
    slurm = recorded_2205()
    gpush = adapter(slurm)
    lose_gpush_9(slurm, gpush)
    registered = slurm.node_list
    slurm.node_list = [replace(n, states=("UNKNOWN",)) if n.name == "gpu01" else n for n in registered]
    gpush.submit(9, spec(), mig())
    assert slurm.cancelled == []
    later = time.monotonic() + 301
    monkeypatch.setattr(slurm_restarts.time, "monotonic", lambda: later)
    gpush.statuses()
    assert slurm.cancelled == ["3", "4", "5"]
    # A broker that restarted knows its placeholders by their name.
    slurm.job_list = [replace(j, states=("PENDING",)) if j.name == "gpush-skip" else j for j in slurm.job_list]
    slurm.node_list = registered
    adapter(slurm).statuses()
    assert slurm.cancelled == ["3", "4", "5"] * 2


def test_a_run_that_ended_before_slurmctld_restarted_is_cancelled_not_reported_running_again():
    # slurmctld restarted from a state saved before gpush-7 ended: it lists the run as
    # running and holds its slice for good (seen on 22.05). gpush saw it end: it cancels it.
    slurm = recorded_2205()
    gpush = adapter(slurm)
    first = gpush.statuses()
    ended = replace(by_name(slurm.job_list)["gpush-7"], states=("COMPLETED",), exit_code=0)
    running_again = by_name(slurm.job_list)["gpush-7"]
    slurm.job_list = [ended if j.name == "gpush-7" else j for j in slurm.job_list]
    assert report(gpush.statuses(first.cursor))[7] == (BackendState.SUCCEEDED, None)
    slurm.job_list = [running_again if j.name == "gpush-7" else j for j in slurm.job_list]

    page = gpush.statuses(first.cursor)

    assert 7 not in report(page) and slurm.cancelled == ["3"]
    assert 7 not in report(gpush.statuses(first.cursor))  # its cancel is no news either


def test_runs_the_job_completion_log_shows_ended_are_found_after_a_start(tmp_path):
    # squeue.json as a controller restarted from a stale state would list it, and the ends
    # of its four running jobs in the job completion log: gpush-7, gpush-9, gpush-10 are
    # gpush's (cancelled, reported as they ended), "filler" is someone else's (reported).
    began = utc("2026-12-03T09:23:02")
    ends = [("3", "gpush-7"), ("4", "filler"), ("5", "gpush-9"), ("6", "gpush-10")]
    jobcomp = tmp_path / "jobcomp.txt"
    jobcomp.write_text(
        "".join(jobcomp_line(int(i), name, "COMPLETED", utc("2026-12-03T09:25:02"), started=began) for i, name in ends)
    )
    slurm = recorded_2205(jobcomp=jobcomp)
    gpush = adapter(slurm)

    page = report(gpush.statuses())

    assert (page[7], page[9], page[10]) == ((BackendState.SUCCEEDED, None),) * 3
    assert sorted(slurm.cancelled) == ["3", "5", "6"]
    detail = gpush.health().detail
    assert (
        "slurmctld lists 1 job as running on mig01 that ended before it restarted from an older state "
        "(Slurm job 4, per the job completion log or accounting); they hold gpu:1g.5gb:6 until an administrator "
        "cancels them (scancel 4): `scontrol reconfigure` would run them again"
    ) in detail
    slurm.job_list = [replace(j, states=("CANCELLED",)) if j.job_id == "4" else j for j in slurm.job_list]
    assert "slurmctld lists" not in gpush.health().detail  # an administrator cancelled it


def test_a_run_requeued_since_is_no_phantom(tmp_path):
    jobcomp = tmp_path / "jobcomp.txt"
    jobcomp.write_text(jobcomp_line(3, "gpush-7", "COMPLETED", utc("2026-12-03T09:25:02")))  # an earlier run
    slurm = recorded_2205(jobcomp=jobcomp)
    assert report(adapter(slurm).statuses())[7] == (BackendState.RUNNING, None)
    assert slurm.cancelled == []


def test_a_job_that_left_squeue_with_no_record_is_reported_failed_with_that_reason(monkeypatch):
    slurm = recorded_2205()
    gpush = adapter(slurm, min_job_age=300)
    first = gpush.statuses()
    slurm.job_list = [job for job in slurm.job_list if job.name != "gpush-9"]
    # The broker looks again only after MinJobAge: the job may have ended and aged out.
    later = time.monotonic() + 301
    monkeypatch.setattr(slurm_status.time, "monotonic", lambda: later)

    page = gpush.statuses(first.cursor)

    assert report(page) == {
        9: (
            BackendState.FAILED,
            "left slurm-a's queue with no record of how it ended "
            "(no accounting, no readable job completion log: set jobcomp_file)",
        )
    }


def test_pending_reasons_say_what_the_job_waits_for():
    slurm = recorded_2205()
    gpush = adapter(slurm)
    pending = by_name(slurm.job_list)["gpush-8"]
    assert gpush.pending_reason(pending) == "waiting in slurm-a for a 1g.5gb slice: all 7 busy"

    behind = SlurmJob.of(dict(raw_job(V2205 / "squeue.json", "gpush-8"), state_reason="Priority"))
    assert (
        gpush.pending_reason(behind) == "waiting in slurm-a for a 1g.5gb slice, behind higher-priority jobs: all 7 busy"
    )

    # a second MPS job like the running gpush-10, waiting: 25 of mps01's 100 are taken
    share = SlurmJob.of(dict(raw_job(V2205 / "squeue.json", "gpush-10"), job_state="PENDING", state_reason="Resources"))
    assert gpush.pending_reason(share) == "waiting in slurm-a for an MPS share of 25 (25 of 100 busy)"

    limited = SlurmJob.of(dict(raw_job(V2205 / "squeue.json", "gpush-8"), state_reason="QOSMaxGRESPerUser"))
    assert "the QOS's limit on GPUs per user (MaxTRESPU=gres/gpu=N; Slurm: QOSMaxGRESPerUser)" in gpush.pending_reason(
        limited
    )


def test_a_job_slurm_requeued_itself_says_so_and_when_it_may_start(monkeypatch):
    # Recorded: "Batch JobId=5 missing from batch node mig01 (not found BatchStartTime
    # after startup), Requeuing job": PENDING, reason BeginTime, restart_cnt 1, eligible
    # again two minutes later.
    requeued = SlurmJob.of(
        dict(
            raw_job(V2205 / "squeue.json", "gpush-9"),
            job_state="PENDING",
            state_reason="BeginTime",
            restart_cnt=1,
            eligible_time=int(utc("2026-12-03T09:30:10").timestamp()),
        )
    )
    assert adapter(recorded_2205()).pending_reason(requeued) == (
        "requeued by slurm-a (it started there once before); waiting for its begin time (2026-12-03 09:30:10 UTC)"
    )
    slurm = recorded_2205()
    gpush = adapter(slurm)
    first = gpush.statuses()
    slurm.job_list = [requeued if job.name == "gpush-9" else job for job in slurm.job_list]
    assert report(gpush.statuses(first.cursor))[9][0] == BackendState.PENDING


def test_a_job_waiting_on_drained_nodes_is_told_so():
    # Recorded: job 9 asks for an a100 in partition exclusive, whose only node gpu01 was
    # drained; 22.05 keeps reason Resources and explains in state_description.
    slurm = RecordedSlurm(jobs_of(V2205 / "squeue_drain.json"), nodes_of(V2205 / "sinfo_drain.json"))
    waiting = by_name(slurm.job_list)["gpush-13"]
    assert waiting.reason == "Resources" and "DRAINED" in waiting.description
    assert adapter(slurm).pending_reason(waiting) == (
        "the nodes of slurm-a that have 1 whole a100 GPU are down, drained or reserved"
    )


# -- submit, find, cancel ---------------------------------------------------------------


def test_submit_sends_a_typed_tagged_job_once():
    slurm = recorded_2205()
    gpush = adapter(slurm)

    first = gpush.submit(20, spec(), whole(1))
    again = gpush.submit(20, spec(), whole(1))

    assert first == again == "1001"
    assert len(slurm.submitted) == 1
    sent = slurm.submitted[0]
    assert (sent.name, sent.gres) == ("gpush-20", "gpu:a100:1")
    assert sent.comment.startswith("gpush:job-20 ")
    assert "--export=ALL" in sent.sbatch_args()


def test_after_a_restart_a_job_slurm_has_is_not_submitted_again():
    slurm = recorded_2205()
    # gpush-7 is in squeue as Slurm job 3 (running): a new adapter finds it
    assert adapter(slurm).submit(7, spec(gpu_memory_gb=5, isolation="hardware"), mig()) == "3"
    # gpush-1 ended, and is still listed: submitting again would run it twice
    assert adapter(slurm).submit(1, spec(), whole(1)) == "1"
    assert slurm.submitted == []


def test_a_refused_submission_left_in_squeue_does_not_count_as_the_job():
    slurm = recorded_2205()
    # gpush-11 is only a FAILED BadConstraints record: Slurm refused it at sbatch
    backend_id = adapter(slurm).submit(11, spec(gpu_memory_gb=5, isolation="hardware"), mig("3g.20gb"))
    assert backend_id == "1001" and [s.name for s in slurm.submitted] == ["gpush-11"]


def test_a_refusal_reaches_the_broker_as_rejected_and_is_not_taken_for_the_job():
    slurm = recorded_2205()
    gpush = adapter(slurm)
    with pytest.raises(Rejected, match="Requested node configuration is not available"):
        gpush.submit(30, spec(gpu_memory_gb=10, isolation="hardware"), mig("2g.10gb"))
    # Slurm left a FAILED BadConstraints record; a new adapter does not take it for the job
    assert adapter(slurm).find(30) is None
    adapter(slurm).submit(30, spec(gpu_memory_gb=10, isolation="hardware"), mig("1g.5gb"))
    assert [s.gres for s in slurm.submitted] == ["gpu:2g.10gb:1", "gpu:1g.5gb:1"]


def test_whole_gpus_are_asked_for_by_the_gres_type_of_their_model():
    slurm = recorded_2205()
    adapter(slurm).submit(40, spec(), whole(2, model="A100-SXM4-40GB", node=None))
    assert slurm.submitted[-1].gres == "gpu:a100:2"
    with pytest.raises(Rejected, match="GPU model H100-SXM5-80GB"):
        adapter(slurm).submit(41, spec(), whole(1, model="H100-SXM5-80GB"))
    assert len(slurm.submitted) == 1


def test_submit_many_submits_a_batch_and_reports_each_outcome():
    slurm = recorded_2205()
    results = adapter(slurm).submit_many(
        [
            (50, spec(), whole(1)),
            (51, spec(gpu_memory_gb=5, isolation="process"), mps(25)),
            (52, spec(), whole(1, model="H100-SXM5-80GB")),
            (7, spec(gpu_memory_gb=5, isolation="hardware"), mig()),
        ]
    )
    assert isinstance(results[0], str) and isinstance(results[1], str)
    assert isinstance(results[2], Rejected)
    assert results[3] == "3"
    assert sorted(s.gres for s in slurm.submitted) == ["gpu:a100:1", "mps:25"]


def test_find_answers_from_squeue_and_then_from_the_log(tmp_path):
    jobcomp = tmp_path / "jobcomp.txt"
    jobcomp.write_text(jobcomp_line(77, "gpush-70", "FAILED", utc("2026-12-03T08:00:00"), exit_code="2:0"))
    gpush = adapter(recorded_2205(jobcomp=jobcomp))

    running = gpush.find(7)
    assert (running.backend_id, running.state, running.node) == ("3", BackendState.RUNNING, "mig01")
    assert gpush.find(2).exit_code == 3
    left = gpush.find(70)
    assert (left.backend_id, left.state, left.exit_code) == ("77", BackendState.FAILED, 2)
    assert left.reason == "exited with code 2"
    assert gpush.find(999) is None
    assert gpush.find(11) is None  # only the refused submission's record


def test_cancel_stops_pending_and_running_jobs_and_nothing_else():
    slurm = recorded_2205()
    gpush = adapter(slurm)
    gpush.cancel(7)  # running
    gpush.cancel(8)  # pending
    gpush.cancel(1)  # completed: nothing to do
    gpush.cancel(999)  # unknown
    assert slurm.cancelled == ["3", "10"]


def test_cancel_reaches_a_job_submitted_a_moment_ago_that_squeue_does_not_list_yet():
    slurm = recorded_2205(lists_new_jobs=False)
    gpush = adapter(slurm)
    backend_id = gpush.submit(60, spec(), whole(1))
    gpush.cancel(60)
    assert slurm.cancelled == [backend_id]


# -- output: where it goes, and reading it back (gpush logs) -----------------------------


def test_every_job_writes_stdout_and_stderr_to_files_named_by_its_gpush_id():
    relative = render(42, spec(), mig(), tag="gpush", gres_type=None, workdir="/scratch/gpush")
    assert (relative.output, relative.error) == (
        "/scratch/gpush/gpush-logs/gpush-42.out",
        "/scratch/gpush/gpush-logs/gpush-42.err",
    )
    shared = render(42, spec(), mig(), tag="gpush", gres_type=None, workdir="/tmp", log_dir="/shared/logs/%u/")
    assert (shared.output, shared.error) == ("/shared/logs/%u/gpush-42.out", "/shared/logs/%u/gpush-42.err")
    in_workdir = render(42, spec(), mig(), tag="gpush", gres_type=None, workdir="/scratch/gpush", log_dir=".")
    assert in_workdir.output == "/scratch/gpush/gpush-42.out"


@pytest.mark.parametrize("log_dir", ["logs/%j", "/shared/%x", "logs\\raw", "%%u", " ", "logs\nx"])
def test_log_dir_takes_no_pattern_but_the_user(log_dir):
    with pytest.raises(InvalidRequest, match="log_dir is a directory.* no pattern but %u"):
        adapter(recorded_2205(), log_dir=log_dir)


def test_submit_creates_the_log_directory_first(tmp_path):
    slurm = recorded_2205()
    gpush = adapter(slurm, workdir=str(tmp_path / "work"), log_dir="logs/%u")
    gpush.submit(42, spec(), mig())
    user = gpush.context.slurm_user()
    assert (tmp_path / "work" / "logs" / user).is_dir()
    assert slurm.submitted[-1].output == f"{tmp_path}/work/logs/%u/gpush-42.out"  # Slurm expands %u itself


def test_a_log_directory_the_broker_cannot_create_is_said_once_and_jobs_still_go(tmp_path, caplog):
    # A broker that does not share the nodes' filesystem: the site made log_dir there.
    (tmp_path / "not-a-directory").write_text("")
    slurm = recorded_2205()
    gpush = adapter(slurm, log_dir=str(tmp_path / "not-a-directory" / "logs"))
    gpush.submit(42, spec(), mig())
    gpush.submit(43, spec(), mig())
    assert [s.name for s in slurm.submitted] == ["gpush-42", "gpush-43"]
    warnings = [r.getMessage() for r in caplog.records if "log directory" in r.getMessage()]
    assert len(warnings) == 1 and "jobs fail at launch unless it exists on the nodes" in warnings[0]


def test_a_job_whose_output_directory_was_missing_on_its_node_says_where_to_look():
    # Slurm 22.05 on a missing --output directory: FAILED, reason JobLaunchFailure, exit 0:53.
    failed = replace(by_name(jobs_of(V2205 / "squeue.json"))["gpush-2"], reason="JobLaunchFailure", exit_code=None)
    backend = adapter(recorded_2205()).states.backend(2, failed)
    assert backend.state == BackendState.FAILED
    assert backend.reason == (
        "Slurm could not start it on its node (JobLaunchFailure): is the cluster's log_dir, "
        "or the job's working directory, missing there? Slurm creates neither"
    )


def test_logs_of_a_job_on_a_node_whose_disk_the_broker_cannot_see_say_where_to_look():
    # Recorded on 22.05: squeue gives the pattern the job was submitted with, unexpanded.
    gpush = adapter(recorded_2205(), **RECORDED_LOG_DIR[V2205])
    assert by_name(gpush.client.jobs())["gpush-7"].standard_output == "/tmp/gpush-slurm-ut/log/%x-%j.out"

    out = gpush.logs(7, "3")

    assert out.readable is False and out.text == "" and out.next_offset == 0
    assert out.location == "node mig01: /tmp/gpush-slurm-ut/log/gpush-7-3.out"
    assert "ssh mig01 tail -f /tmp/gpush-slurm-ut/log/gpush-7-3.out" in out.note
    assert "set the cluster's log_dir to a directory on a filesystem the broker shares" in out.note
    # Submitted without --error (before gpush set it): stderr is in the same file.
    err = gpush.logs(7, "3", stream="stderr")
    assert err.location == out.location


@pytest.mark.parametrize("folder", NEWER)
def test_logs_of_24_11_and_26_05_read_the_path_slurm_expanded(folder):
    # 24.11 (v0.0.42) gives standard_output expanded; 26.05 (v0.0.45) the pattern it was
    # submitted with, %x-%j.out, which the adapter expands as Slurm did
    out = adapter(recorded_newer(folder), **RECORDED_LOG_DIR[folder]).logs(7, "4")
    assert (out.readable, out.location) == (False, f"node mig01: /tmp/gpush-slurm-{folder.name}/log/gpush-7-4.out")


def running(tmp_path: Path, slurm: RecordedSlurm, name: str = "gpush-7") -> SlurmJob:
    """Job ``name`` of the recorded cluster, writing where this test reads (as on a shared
    filesystem): into log_dir ``logs`` of the test's workdir (``adapter(slurm, log_dir="logs")``)."""
    job = by_name(slurm.job_list)[name]
    moved = replace(job, standard_output=f"{tmp_path}/logs/%x-%j.out", standard_error=f"{tmp_path}/logs/%x-%j.err")
    slurm.job_list = [moved if j is job else j for j in slurm.job_list]
    (tmp_path / "logs").mkdir(exist_ok=True)
    return moved


def test_logs_read_on_from_an_offset_in_characters_a_chunk_at_a_time(tmp_path, monkeypatch):
    slurm = recorded_2205()
    running(tmp_path, slurm)
    out_file = tmp_path / "logs" / "gpush-7-3.out"
    out_file.write_text("épоch 1\népоch 2\n")  # two-byte and Cyrillic letters: 16 characters, 21 bytes
    (tmp_path / "logs" / "gpush-7-3.err").write_text("slow\n")
    monkeypatch.setattr(slurm_logs, "MAX_LOG_CHUNK", 10)
    gpush = adapter(slurm, log_dir="logs")

    first = gpush.logs(7, "3")
    assert (first.readable, first.location, first.text, first.next_offset) == (
        True,
        f"node mig01: {out_file}",
        "épоch 1\nép",
        10,
    )
    second = gpush.logs(7, "3", offset=first.next_offset)
    assert (second.text, second.next_offset) == ("оch 2\n", 16)
    assert gpush.logs(7, "3", offset=16).text == ""  # nothing new yet
    with out_file.open("a") as f:  # the job prints on (gpush logs -f)
        f.write("done\n")
    assert (gpush.logs(7, "3", offset=16).text, gpush.logs(7, "3", offset=16).next_offset) == ("done\n", 21)
    assert gpush.logs(7, "3", stream="stderr").text == "slow\n"
    # Another broker process, which never handed out offset 13, counts it from the top.
    assert adapter(slurm, log_dir="logs").logs(7, "3", offset=13).text == " 2\ndone\n"


def test_logs_tail_gives_the_last_lines_and_where_to_read_on(tmp_path):
    slurm = recorded_2205()
    running(tmp_path, slurm)
    out_file = tmp_path / "logs" / "gpush-7-3.out"
    out_file.write_text("".join(f"step {i}\r{i}%\n" for i in range(1, 2001)))  # a progress bar's \r is no line end
    gpush = adapter(slurm, log_dir="logs")

    tail = gpush.logs(7, "3", tail=2)

    assert tail.text == "step 1999\r1999%\nstep 2000\r2000%\n"
    assert tail.next_offset == len(out_file.read_text())
    with out_file.open("a") as f:
        f.write("saved\n")
    assert gpush.logs(7, "3", offset=tail.next_offset).text == "saved\n"
    assert gpush.logs(7, "3", tail=0).text == ""


def test_logs_of_a_job_that_has_not_started_or_never_did_are_refused():
    gpush = adapter(recorded_2205())
    with pytest.raises(Rejected, match="^job 8 has not started on slurm-a yet: no output$"):
        gpush.logs(8, "10")  # pending: all 7 slices busy
    with pytest.raises(Rejected, match="^job 14 never started on slurm-a: no output$"):
        gpush.logs(14, "11")  # cancelled while pending
    with pytest.raises(Rejected, match="^job 11 never started on slurm-a: no output$"):
        gpush.logs(11, "7")  # refused at submission


def test_logs_refuse_a_replica_or_a_stream_slurm_does_not_have():
    gpush = adapter(recorded_2205(), **RECORDED_LOG_DIR[V2205])
    # A multi-node job's ranks (gpush logs -r RANK) all write to the one file, as srun gathers them.
    with pytest.raises(
        Rejected,
        match=r"^job 7 is one Slurm job on slurm-a with one output file, every rank's lines in it "
        r"\(srun gathers them\): it has no replica or rank 1 of its own; `gpush logs 7` reads them all$",
    ):
        gpush.logs(7, "3", replica=1)
    with pytest.raises(Rejected, match="stdout and stderr; not 'both'"):
        gpush.logs(7, "3", stream="both")
    assert gpush.logs(7, "3", replica=0).location.startswith("node mig01: ")


def test_logs_of_a_job_that_left_squeue_are_found_by_its_gpush_id(tmp_path):
    # jobcomp.txt knows the node and working directory (/tmp) but not the files: they are
    # where gpush asked Slurm to put them, found from the gpush id alone.
    slurm = recorded_2205(jobcomp=V2205 / "jobcomp.txt")
    slurm.job_list = []
    gpush = adapter(slurm, log_dir=str(tmp_path / "logs"))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "gpush-2.err").write_text("Traceback: exit 3\n")

    err = gpush.logs(2, "2", stream="stderr")

    assert (err.readable, err.text) == (True, "Traceback: exit 3\n")
    assert err.location == f"node gpu01: {tmp_path}/logs/gpush-2.err"
    gone = gpush.logs(2, "2")
    assert (gone.readable, gone.location) == (False, f"node gpu01: {tmp_path}/logs/gpush-2.out")
    # Slurm forgot it altogether: where gpush asked for it, node unknown.
    nowhere = gpush.logs(99, "4242")
    assert (nowhere.readable, nowhere.location) == (False, f"{tmp_path}/logs/gpush-99.out")
    assert "Slurm no longer says which node ran job 99: read it on that node" in nowhere.note


@pytest.mark.parametrize("folder", NEWER)
def test_logs_from_24_11_and_26_05_accounting_read_the_expanded_paths(tmp_path, folder):
    stand_in(tmp_path, "sacct", f"cat '{folder / 'sacct.json'}'")
    stand_in(tmp_path, "squeue", "echo '{\"jobs\": []}'")
    gpush = adapter(CliBackend(bin_dir=str(tmp_path)), **RECORDED_LOG_DIR[folder])
    assert gpush.logs(1, "1").location == f"node gpu01: /tmp/gpush-slurm-{folder.name}/log/gpush-1-1.out"
    with pytest.raises(Rejected, match="job 14 never started"):
        gpush.logs(14, "12")  # nodes: "None assigned"


def test_slurm_filename_patterns_expand_as_slurm_does():
    # As Slurm 22.05 named the files of job 5 "pat" of root on gpu01 (the test cluster).
    pattern = "/o/%J_%s_%a_%A_%N_%n_%t_%5j_%u_%x_%%.out"
    assert expand_filename(pattern, job_id="5", name="pat", user="root", node="gpu01") == (
        "/o/5_batch_4294967294_5_gpu01_0_0_00005_root_pat_%.out"
    )
    assert expand_filename("/o/a\\%j.err", job_id="5") == "/o/a%j.err"  # a backslash: no expansion


# -- the REST backend against recorded slurmrestd answers ---------------------------------


def recorded_answer(folder: Path, what: str) -> tuple[int, dict[str, Any]]:
    """The HTTP status and body slurmrestd answered, from ``<what>_<status>.json``: a
    refused submission is HTTP 500 on 22.05 and 24.11, 422 on 26.05; cancelling an
    unknown job 500 on 22.05, 200 with the error in ``status`` from 24.11 on."""
    (path,) = folder.glob(f"{what}_[0-9][0-9][0-9].json")
    return int(path.stem.rsplit("_", 1)[1]), answer(path)


class RecordedRestd:
    """slurmrestd as recorded: the paths its OpenAPI lists, answers from files, JWT needed."""

    def __init__(
        self, folder: Path, *, versions: set[str] | None = None, token: str = "jwt-1", registering: bool = False
    ):
        self.folder = folder
        self.token = token
        self.registering = registering  # slurmctld restarted a moment ago: no node has registered yet
        self.spec = answer(folder / "rest_openapi_v3.json")
        if versions is not None:
            self.spec["paths"] = {
                p: v
                for p, v in self.spec["paths"].items()
                if not p.startswith("/slurm/") or p.split("/")[2] in versions
            }
        self.requests: list[httpx.Request] = []
        self.gres = {(g.name, g.type) for n in self.nodes()["nodes"] for g in SlurmNode.of(n).gres}

    def nodes(self) -> dict[str, Any]:
        return answer(self.folder / ("rest_nodes.json" if (self.folder / "rest_nodes.json").exists() else "nodes.json"))

    def jobs(self) -> dict[str, Any]:
        return answer(self.folder / ("rest_jobs.json" if (self.folder / "rest_jobs.json").exists() else "squeue.json"))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.headers.get("X-SLURM-USER-TOKEN") != self.token or not request.headers.get("X-SLURM-USER-NAME"):
            return httpx.Response(401, text="Authentication failure")
        path = request.url.path
        if path == "/openapi/v3":
            return httpx.Response(200, json=self.spec)
        match = re.fullmatch(r"/slurm/(v[\d.]+)/(.+)", path)
        # 24.11 and 26.05 list their paths with a trailing slash (/slurm/v0.0.42/ping/)
        # and answer them without one
        if match is None or not {f"/slurm/{match[1]}/ping", f"/slurm/{match[1]}/ping/"} & set(self.spec["paths"]):
            return httpx.Response(404, text="Unable to find requested URL")
        what = match[2]
        if what == "ping":
            return httpx.Response(200, json=answer(self.folder / "rest_ping.json"))
        if what == "jobs":
            return httpx.Response(200, json=self.jobs())
        if what == "nodes":
            return httpx.Response(200, json=self.nodes())
        if what == "job/submit":
            job = json.loads(request.content)["job"]
            if job.get("hold") and (self.folder / "rest_submit_held_200.json").exists():
                return httpx.Response(200, json=answer(self.folder / "rest_submit_held_200.json"))
            asked = parse_gres(job.get("gres") or job.get("tres_per_node") or job.get("tres_per_job"))[0]
            if (asked.name, asked.type) not in self.gres:
                status, body = recorded_answer(self.folder, "rest_submit_refused")
                return httpx.Response(status, json=body)
            if self.registering:
                return httpx.Response(200, json=answer(self.folder / "rest_submit_node_not_avail_200.json"))
            return httpx.Response(200, json=answer(self.folder / "rest_submit_200.json"))
        if request.method == "DELETE" and what.startswith("job/") and (self.folder / "rest_cancel_200.json").exists():
            if what.removeprefix("job/") in {str(j["job_id"]) for j in self.jobs()["jobs"]}:
                return httpx.Response(200, json=answer(self.folder / "rest_cancel_200.json"))
            status, body = recorded_answer(self.folder, "rest_cancel_unknown")
            return httpx.Response(status, json=body)
        return httpx.Response(404, text="Unable to find requested URL")


def rest(restd: RecordedRestd, **kwargs: Any) -> RestBackend:
    kwargs.setdefault("token", "jwt-1")
    return RestBackend(url="http://slurm-head:6820", user="gpush", transport=httpx.MockTransport(restd), **kwargs)


def submission(gres: str = "gpu:1g.5gb:1") -> Submission:
    placement = mig(gres.split(":")[1]) if gres.startswith("gpu:") else mps(int(gres.split(":")[1]))
    job = render(
        7,
        spec(gpu_memory_gb=5, isolation="hardware", memory="2G", time_limit="90"),
        placement,
        tag="gpush",
        gres_type=None,
    )
    assert job.gres == gres
    return job


@pytest.mark.parametrize(("folder", "job_id"), [(V2205, "2"), (V2411, "15"), (V2605, "15")])
def test_rest_takes_slurms_held_answer_to_a_held_job_for_its_id(folder, job_id):
    # Recorded from slurmrestd 22.05: a job submitted held comes back with its id and
    # error 2042 "Job is in held state, pending scheduler release", which sbatch keeps to
    # itself. For a held job that is the answer asked for, not a refusal. 24.11 and 26.05
    # say the same as two warnings, with no error.
    held_answer = answer(folder / "rest_submit_held_200.json")
    assert bool(held_answer["errors"]) is (folder == V2205)
    held = replace(submission(), name="gpush-skip", gres="", hold=True)
    assert rest(RecordedRestd(folder)).submit(held) == job_id


def test_rest_takes_a_job_slurm_created_but_cannot_start_yet_for_submitted():
    # Recorded from slurmrestd 22.05 right after slurmctld restarted, before the nodes had
    # registered: HTTP 200, error 2068, and the id of a job Slurm queued and later ran.
    # sbatch prints the id alone. Taken for a refusal, gpush failed a job Slurm then ran.
    assert rest(RecordedRestd(V2205, registering=True)).submit(submission()) == "32"


def test_rest_on_22_05_discovers_v0_0_38_and_reads_the_cluster():
    restd = RecordedRestd(V2205)
    backend = rest(restd)
    assert backend.api_version() == "v0.0.38"
    assert backend.version() == "22.05.8"
    assert backend.ping() == "UP"
    jobs = by_name(backend.jobs())
    assert (jobs["gpush-7"].state, jobs["gpush-13"].state) == ("RUNNING", "PENDING")
    assert {n.name for n in backend.nodes()} == {"mig01", "mps01", "gpu01"}
    assert all(r.headers["X-SLURM-USER-NAME"] == "gpush" for r in restd.requests)


def test_rest_on_22_05_sends_the_legacy_job_body():
    restd = RecordedRestd(V2205)
    job = submission()
    assert rest(restd).submit(job) == "13"

    body = json.loads(restd.requests[-1].content)
    assert restd.requests[-1].url.path == "/slurm/v0.0.38/job/submit"
    assert body["script"] == job.script
    sent = body["job"]
    assert sent["gres"] == "gpu:1g.5gb:1" and "tres_per_node" not in sent
    assert sent["environment"] == job.environment  # an object in v0.0.38
    assert (sent["name"], sent["comment"]) == ("gpush-7", job.comment)
    assert (sent["memory_per_node"], sent["time_limit"]) == (2048, 90)
    assert (sent["standard_output"], sent["standard_error"]) == (job.output, job.error)


@pytest.mark.parametrize(("folder", "api"), [(V2411, "v0.0.42"), (V2605, "v0.0.45")])
def test_rest_on_24_11_and_26_05_discovers_the_newest_api_it_speaks_and_sends_the_new_body(folder, api):
    restd = RecordedRestd(folder)
    backend = rest(restd)
    assert backend.api_version() == api
    assert answer(folder / "rest_jobs.json")["meta"]["plugin"]["data_parser"] == f"data_parser/{api}"
    assert backend.version() == RELEASE[folder]
    assert backend.ping() == "UP"
    assert backend.submit(submission()) == "14"

    sent = json.loads(restd.requests[-1].content)["job"]
    assert restd.requests[-1].url.path == f"/slurm/{api}/job/submit"
    assert sent["tres_per_node"] == "gres/gpu:1g.5gb=1" and "gres" not in sent
    assert "GPUSH_JOB_ID=7" in sent["environment"]  # a list of NAME=value
    assert sent["memory_per_node"] == {"set": True, "number": 2048}
    assert sent["time_limit"] == {"set": True, "number": 90}
    assert (sent["standard_output"], sent["standard_error"]) == (
        "/tmp/gpush-logs/gpush-7.out",
        "/tmp/gpush-logs/gpush-7.err",
    )

    jobs = by_name(backend.jobs())
    assert (jobs["gpush-7"].states, jobs["gpush-8"].reason) == (("RUNNING",), "Resources")
    # submitted over REST as gres/gpu:a100=1, listed as sent
    assert jobs["gpush-16"].tres_per_node == (Gres("gpu", "a100", 1),)
    assert {n.name: n.states[0] for n in backend.nodes()} == {"gpu01": "MIXED", "mig01": "MIXED", "mps01": "MIXED"}


def test_rest_takes_v0_0_41_when_the_server_offers_nothing_newer_and_refuses_unknown_ones():
    assert rest(RecordedRestd(V2411, versions={"v0.0.40", "v0.0.41"})).api_version() == "v0.0.41"
    assert rest(RecordedRestd(V2605, versions={"v0.0.42", "v0.0.43"})).api_version() == "v0.0.43"
    future = RecordedRestd(V2411, versions=set())
    future.spec["paths"]["/slurm/v0.0.46/ping"] = {"get": {}}
    with pytest.raises(Unreachable, match=r"serves v0\.0\.46; gpush speaks v0\.0\.45, v0\.0\.44"):
        rest(future).api_version()


def test_rest_refusals_are_rejected_with_slurms_message():
    restd = RecordedRestd(V2205)
    with pytest.raises(Rejected, match="Slurm refused the job: Requested node configuration is not available"):
        rest(restd).submit(submission("gpu:2g.10gb:1"))
    for newer in NEWER:  # HTTP 500 on 24.11, 422 on 26.05
        with pytest.raises(Rejected, match="Slurm refused the job: Requested node configuration is not available"):
            rest(RecordedRestd(newer)).submit(submission("gpu:2g.10gb:1"))


def refused_with(folder: Path, error: str, number: int) -> dict[str, Any]:
    """The recorded refusal of ``folder``, with another of Slurm's errors in its place."""
    body = recorded_answer(folder, "rest_submit_refused")[1]
    body["errors"][0]["error"] = error
    body["errors"][0]["error_number" if "error_number" in body["errors"][0] else "error_code"] = number
    return body


@pytest.mark.parametrize("folder", [V2205, *NEWER])
@pytest.mark.parametrize(
    ("status", "body", "error", "words"),
    [
        # Any refusal of the job is a refusal, not only those on a list of known ones.
        (500, ("Invalid job array specification", 2057), Rejected, "Slurm refused the job: Invalid job array"),
        (500, ("Job name is too long", 2143), Rejected, "Slurm refused the job: Job name is too long"),
        # slurmrestd could not reach slurmctld: an outage, tried again next cycle.
        (500, ("Unable to contact slurm controller (connect failure)", 1001), Unreachable, "Unable to contact"),
        (500, ("Socket timed out on send/recv operation", 5004), Unreachable, "Socket timed out"),
        (500, ("Communication connection failure", 1001), Unreachable, "Communication connection failure"),
        # No Slurm error in the answer: a proxy or a server that is not slurmrestd.
        (502, None, Unreachable, "Bad Gateway"),
    ],
)
def test_rest_a_refusal_of_the_job_is_rejected_and_only_an_outage_is_unreachable(folder, status, body, error, words):
    restd = RecordedRestd(folder)
    backend = rest(restd)
    backend.api_version()

    def answer_submit(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/job/submit"):
            if body is None:
                return httpx.Response(status, text="<html>502 Bad Gateway</html>")
            return httpx.Response(status, json=refused_with(folder, *body))
        return restd(request)

    backend.http = httpx.Client(base_url=backend.http.base_url, transport=httpx.MockTransport(answer_submit))
    with pytest.raises(error, match=re.escape(words)) as info:
        backend.submit(submission())
    assert type(info.value) is error


@pytest.mark.parametrize(("folder", "known"), [(V2205, "9"), (V2411, "14"), (V2605, "14")])
def test_rest_cancel_of_a_job_slurm_no_longer_knows_is_not_an_error(folder, known):
    restd = RecordedRestd(folder)
    backend = rest(restd)
    backend.cancel(known)
    # recorded: "Invalid job id specified", HTTP 500 on 22.05; from 24.11 on HTTP 200 with
    # the error in "status" and none in "errors"
    backend.cancel("99999")
    api = backend.api_version()
    assert [r.url.path for r in restd.requests if r.method == "DELETE"] == [
        f"/slurm/{api}/job/{known}",
        f"/slurm/{api}/job/99999",
    ]


def test_rest_token_problems_are_unreachable_with_what_to_do(tmp_path, monkeypatch):
    restd = RecordedRestd(V2205)
    with pytest.raises(Unreachable, match=r"refused the token \(401\): renew it"):
        rest(restd, token="expired", api_version="v0.0.38").version()
    with pytest.raises(Unreachable, match="no Slurm token: set token_env or token_file"):
        rest(restd, token=None).version()
    monkeypatch.delenv("GPUSH_TEST_JWT", raising=False)
    with pytest.raises(Unreachable, match="environment variable GPUSH_TEST_JWT is not set"):
        rest(restd, token=None, token_env="GPUSH_TEST_JWT").version()

    token_file = tmp_path / "jwt"
    token_file.write_text("SLURM_JWT=jwt-1\n")  # as `scontrol token` prints it
    assert rest(restd, token=None, token_file=str(token_file)).version() == "22.05.8"


def test_rest_connection_errors_are_unreachable_and_only_reads_are_retried(monkeypatch):
    calls: list[str] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        raise httpx.ConnectError("Connection refused")

    monkeypatch.setattr(RestBackend.jobs.retry, "sleep", lambda seconds: None)
    backend = RestBackend(
        url="http://slurm-head:6820",
        user="gpush",
        token="jwt-1",
        api_version="v0.0.38",
        transport=httpx.MockTransport(refuse),
    )

    with pytest.raises(Unreachable, match="slurmrestd at http://slurm-head:6820"):
        backend.submit(submission())
    assert calls == ["POST"]  # a submission is never repeated
    with pytest.raises(Unreachable):
        backend.jobs()
    assert calls == ["POST", "GET", "GET", "GET"]


# -- the command-line backend with stand-in Slurm commands ------------------------------


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


@pytest.mark.parametrize("folder", NEWER)
def test_cli_on_24_11_and_26_05_reads_nodes_from_scontrol_when_sinfo_groups_them(tmp_path, folder):
    stand_in(tmp_path, "sinfo", f"cat '{folder / 'sinfo.json'}'")
    stand_in(tmp_path, "scontrol", f'[ "$*" = "--json show nodes" ] || exit 1\ncat \'{folder / "nodes_drain.json"}\'')
    grouped = answer(folder / "sinfo.json")
    assert "sinfo" in grouped and "nodes" not in grouped
    # one entry per partition and node group: gpu01, mig01 and mps01 each twice
    listed = sorted(n for group in grouped["sinfo"] for n in group["nodes"]["nodes"])
    assert listed == ["gpu01", "gpu01", "mig01", "mig01", "mps01", "mps01"]

    nodes = {n.name: n for n in CliBackend(bin_dir=str(tmp_path)).nodes()}

    assert set(nodes) == {"mig01", "mps01", "gpu01"}
    assert nodes["gpu01"].unavailable == "node gpu01 is drain: gpu 1 fell off the bus"


@pytest.mark.parametrize("folder", NEWER)
def test_cli_on_24_11_and_26_05_asks_squeue_for_finished_jobs_too(tmp_path, folder):
    # 22.05's squeue --json ignored filters and listed every job slurmctld still knew;
    # 24.11 and 26.05 apply squeue's default filter: recorded at the same moment, plain
    # squeue --json listed only the 9 unfinished jobs (squeue_default.json keeps one, which
    # runs: none of the finished jobs below).
    live_only = answer(folder / "squeue_default.json")["jobs"]
    assert [(job["name"], job["job_state"]) for job in live_only] == [("gpush-7", ["RUNNING"])]
    stand_in(
        tmp_path,
        "squeue",
        f'if [ "$*" = "--json --states=all" ]; then cat \'{folder / "squeue.json"}\'; '
        f"else cat '{folder / 'squeue_default.json'}'; fi",
    )

    jobs = by_name(CliBackend(bin_dir=str(tmp_path)).jobs())

    # A job that ended is still seen ending (without it, one that ended before MinJobAge
    # was taken for a job slurmctld lost, where neither accounting nor a job completion
    # log said how it ended)
    assert (jobs["gpush-1"].state, jobs["gpush-2"].exit_code, jobs["gpush-14"].state) == ("COMPLETED", 3, "CANCELLED")
    assert (jobs["gpush-11"].state, jobs["gpush-11"].reason) == ("FAILED", "BadConstraints")
    assert jobs["gpush-7"].state == "RUNNING"


def test_cli_on_22_05_reads_sinfo_and_squeue_as_recorded(tmp_path):
    stand_in(tmp_path, "sinfo", f"cat '{V2205 / 'sinfo.json'}'")
    stand_in(tmp_path, "squeue", f"cat '{V2205 / 'squeue.json'}'")
    backend = CliBackend(bin_dir=str(tmp_path))
    assert {n.name for n in backend.nodes()} == {"mig01", "mps01", "gpu01"}
    assert by_name(backend.jobs())["gpush-2"].exit_code == 3


def test_cli_submit_passes_argv_without_a_shell_and_the_script_on_stdin(tmp_path):
    stand_in(
        tmp_path, "sbatch", f'printf "%s\\n" "$@" > "{tmp_path}/argv"\ncat > "{tmp_path}/stdin"\necho "4242;gpush"'
    )
    job = render(
        7, spec(name="bert.v2@run-1", env={"NOTE": "two words; $(no)"}), whole(1), tag="gpush", gres_type="a100"
    )

    assert CliBackend(bin_dir=str(tmp_path)).submit(job) == "4242"

    assert (tmp_path / "argv").read_text().splitlines() == job.sbatch_args()
    assert (tmp_path / "stdin").read_text() == job.script


@pytest.mark.parametrize(
    ("stderr", "error"),
    [
        ("sbatch: error: Batch job submission failed: Requested node configuration is not available", Rejected),
        (
            "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
            Rejected,
        ),
        ("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", Unreachable),
        # Refusals of the job that were not on a list of known ones were taken for an
        # outage: the job was submitted again every cycle, for ever.
        ("sbatch: error: Batch job submission failed: Invalid job array specification", Rejected),
        ("sbatch: error: Batch job submission failed: Job name is too long", Rejected),
        (
            "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
            Unreachable,
        ),
        ("sbatch: error: Batch job submission failed: Zero Bytes were transmitted or received", Unreachable),
        ("sbatch: error while loading shared libraries: libslurmfull.so: cannot open shared object file", Unreachable),
    ],
)
def test_cli_submit_maps_slurms_refusals_and_failures(tmp_path, stderr, error):
    stand_in(tmp_path, "sbatch", f"echo '{stderr}' >&2\nexit 1")
    with pytest.raises(error, match=re.escape(stderr.rsplit(": ", 1)[-1])):
        CliBackend(bin_dir=str(tmp_path)).submit(submission())


def test_cli_a_script_sbatch_refuses_is_rejected_with_all_of_sbatchs_words(tmp_path):
    # sbatch's answer to a script with a carriage return, as it prints it (two lines).
    stand_in(
        tmp_path,
        "sbatch",
        r"printf '%s\n' 'sbatch: error: Batch script contains DOS line breaks (\r\n)' >&2"
        "\n"
        r"printf '%s\n' 'sbatch: error: instead of expected UNIX line breaks (\n).' >&2"
        "\nexit 1",
    )
    with pytest.raises(Rejected, match=r"DOS line breaks \(\\r\\n\) instead of expected UNIX line breaks"):
        CliBackend(bin_dir=str(tmp_path)).submit(submission())


def test_cli_sbatch_killed_or_silent_is_unreachable(tmp_path):
    stand_in(tmp_path, "sbatch", "kill -9 $$")
    with pytest.raises(Unreachable):
        CliBackend(bin_dir=str(tmp_path)).submit(submission())
    stand_in(tmp_path, "sbatch", "exit 1")
    with pytest.raises(Unreachable, match="sbatch exited 1"):
        CliBackend(bin_dir=str(tmp_path)).submit(submission())


@pytest.mark.parametrize(("folder", "ended"), [(V2411, "2026-12-06T03:30:43"), (V2605, "2026-12-06T03:33:19")])
def test_cli_finished_reads_24_11_and_26_05_accounting(tmp_path, folder, ended):
    stand_in(tmp_path, "sacct", f"cat '{folder / 'sacct.json'}'")
    records = {r.name: r for r in CliBackend(bin_dir=str(tmp_path)).finished(None)}
    assert (records["gpush-1"].state, records["gpush-1"].exit_code) == ("COMPLETED", 0)
    assert (records["gpush-2"].state, records["gpush-2"].exit_code, records["gpush-2"].nodes) == ("FAILED", 3, "gpu01")
    assert records["gpush-3"].exit_code == 137
    assert records["gpush-1"].end_time == records["gpush-1"].start_time == utc(ended)
    assert (records["gpush-1"].standard_output, records["gpush-1"].user) == (
        f"/tmp/gpush-slurm-{folder.name}/log/gpush-1-1.out",
        "root",
    )
    # sacct's start of a job that never started is Slurm's NO_VAL, 4294967294: no time
    # (read as one, it was 2106-02-07)
    cancelled = records["gpush-14"]
    assert answer(folder / "sacct.json")["jobs"][-1]["time"]["start"] == 0xFFFFFFFE
    assert (cancelled.state, cancelled.nodes, cancelled.start_time) == ("CANCELLED", "None assigned", None)
    assert cancelled.end_time is not None


def test_cli_without_accounting_falls_back_to_the_jobcomp_log_and_stops_asking(tmp_path):
    stand_in(
        tmp_path,
        "sacct",
        f'echo x >> "{tmp_path}/asked"\necho "sacct: error: Slurm accounting storage is disabled" >&2\nexit 1',
    )
    backend = CliBackend(bin_dir=str(tmp_path), jobcomp_file=str(V2205 / "jobcomp.txt"))
    assert {r.name for r in backend.finished(None)} >= {"gpush-1", "gpush-2", "gpush-7", "gpush-9"}
    backend.finished(None)
    assert (tmp_path / "asked").read_text() == "x\n"


def test_cli_without_slurm_commands_is_unreachable(tmp_path):
    with pytest.raises(Unreachable, match="sbatch not found"):
        CliBackend(bin_dir=str(tmp_path)).submit(submission())


def test_make_client_picks_rest_for_a_url_and_the_command_line_otherwise():
    assert isinstance(slurm_client.make_client({"rest_url": "http://slurm-head:6820", "token": "x"}), RestBackend)
    assert isinstance(slurm_client.make_client({}), CliBackend)


@pytest.mark.parametrize("folder", [V2411, V2605])
def test_rest_cancel_slurm_refuses_in_status_is_not_taken_for_done(folder):
    # From v0.0.40 on a refused cancel is HTTP 200 with the error only in status[]: the
    # recorded unknown-job answer, with another of Slurm's errors in its place.
    body = answer(folder / "rest_cancel_unknown_200.json")
    body["status"][0]["error"].update(string="Access/permission denied", message="Access/permission denied", code=2002)
    restd = RecordedRestd(folder)
    backend = rest(restd)

    def refuse(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(200, json=body)
        return restd(request)

    backend.http = httpx.Client(base_url=backend.http.base_url, transport=httpx.MockTransport(refuse))
    with pytest.raises(Unreachable, match="Access/permission denied"):
        backend.cancel("14")


def test_the_inventory_is_never_older_than_the_job_states_the_broker_last_read():
    """A cycle reads the jobs' states (a placement Slurm has started is no longer counted
    as pending) and then the inventory: the nodes must be read after those states, or a
    job Slurm started in between is counted nowhere, its GPUs look free, and the next job
    gpush pins there waits in Slurm's queue until it ends (the gang bench on the test
    cluster: jobs 20-40 s in Slurm's queue). Within the cache time, nodes read after the
    states are reused."""
    client = recorded_2205()
    gpu01 = next(n for n in client.node_list if n.name == "gpu01")
    client.node_list = [replace(n, gres_used=()) if n is gpu01 else n for n in client.node_list]
    slurm = adapter(client, cache_seconds=60)

    def free_on_gpu01() -> int:
        return next(u.free for u in slurm.inventory() if u.node == "gpu01" and u.sharing == Sharing.SLURM_EXCLUSIVE)

    assert free_on_gpu01() == 2
    # Slurm starts a job on both of gpu01's GPUs; the broker reads the jobs' states
    client.node_list = [replace(n, gres_used=(Gres("gpu", "a100", 2),)) if n.name == "gpu01" else n
                        for n in client.node_list]  # fmt: skip
    slurm.statuses(None)
    assert free_on_gpu01() == 0
    reads = []
    client.nodes = lambda: reads.append(1) or list(client.node_list)
    free_on_gpu01()
    assert reads == []  # read after the states: the cache serves it
