"""What another Slurm user, or a gpush job itself, may do to make the Slurm adapter take
or read what is not the job's (issue 32, finding 1), over Slurm's recorded answers
(tests/data/slurm/): 22.05, 24.11 and 26.05.

- **Impostors.** Any Slurm user may name a job ``gpush-<id>`` (or comment it
  ``gpush:job-<id>``) with any output path and working directory. The adapter takes a
  record for gpush's only if it runs as the user (and account) gpush submitted the job as,
  and is no newer than the Slurm job gpush recorded: an impostor is never reported,
  found, cancelled or read.
- **Links and other people's files.** A job may replace its output file, or its log
  directory, with a symbolic link to a file only the broker may read. ``gpush logs``
  reads only a regular file of the job's user in the log directory, reached through no
  link; anything else is refused, never shown.

The integration tests run the same attacks on the real Slurm test cluster
(integration/test_slurm_adapter.py, integration/test_slurm_identity.py).
"""

from __future__ import annotations

import logging
import os
import pwd
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from adapters.slurm.adapter import SlurmAdapter
from adapters.slurm.client import SlurmClient
from adapters.slurm.records import SlurmJob
from broker.core.adapter import Owner, Rejected
from tests.adapters.test_slurm_adapter import (
    NEWER,
    V2205,
    RecordedSlurm,
    by_name,
    jobcomp_line,
    recorded_2205,
    recorded_newer,
    spec,
    utc,
    whole,
)

SECRET = "the broker's own secret: nobody else may read this\n"
# Where the recorded jobs wrote their output.
RECORDED_DIRS = ("/tmp/gpush-slurm-ut/log", "/tmp/gpush-slurm-2411/log", "/tmp/gpush-slurm-2605/log")


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file only the broker's user may read (0600 in a 0700 directory), outside every log directory."""
    private = tmp_path / "broker-only"
    private.mkdir(mode=0o700)
    path = private / "secret"
    path.write_text(SECRET)
    path.chmod(0o600)
    return path


def gpush_adapter(client: SlurmClient, workdir: Path, **config: Any) -> SlurmAdapter:
    """The adapter with its jobs' log directory ``<workdir>/logs``."""
    settings = {"cache_seconds": 0, "workdir": str(workdir), "log_dir": "logs", **config}
    return SlurmAdapter("slurm-a", settings, client=client)


def recorded(folder: Path) -> RecordedSlurm:
    return recorded_2205() if folder == V2205 else recorded_newer(folder)


def impostor(record: SlurmJob, job_id: str, user: str = "mallory", **changes: Any) -> SlurmJob:
    """``record`` as another Slurm user submitted it again (sbatch -J gpush-N ...)."""
    return replace(record, job_id=job_id, user=user, account=user, **changes)


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is not gpush's" in r.getMessage()]


# -- impostors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tag",
    [{"name": "gpush-7"}, {"name": "innocent", "comment": "gpush:job-7 tenant=ml user=alice"}],
    ids=["name", "comment"],
)
def test_another_users_job_carrying_a_gpush_tag_is_not_taken_for_the_job(tmp_path, caplog, tag):
    slurm = recorded_2205()
    own = by_name(slurm.job_list)["gpush-7"]  # Slurm job 3, root's, running on mig01
    slurm.job_list.append(impostor(own, "40", **tag))  # mallory's, newer than gpush's
    gpush = gpush_adapter(slurm, tmp_path)
    caplog.set_level(logging.WARNING)

    assert gpush.find(7).backend_id == "3"
    assert {job.job_id: job.backend_id for job in gpush.statuses().jobs}[7] == "3"
    gpush.cancel(7)
    assert slurm.cancelled == ["3"]  # never mallory's job, with the broker's rights
    assert said(caplog) == [
        "slurm-a: Slurm job 40 of user mallory carries the tag of gpush job 7 but is not gpush's "
        "(gpush runs its jobs on slurm-a as user root): ignored"
    ]  # once, however often it was met


@pytest.mark.parametrize("folder", [V2205, *NEWER], ids=lambda f: f.name)
def test_logs_never_read_the_file_an_impostor_named_once_gpushs_own_job_left_squeue(tmp_path, secret, folder):
    slurm = recorded(folder)
    own = by_name(slurm.job_list)["gpush-7"]
    # gpush's run left squeue (MinJobAge) and no record keeps it; mallory's job named
    # gpush-7, with the broker's secret as its output, is what squeue lists.
    fake = impostor(own, "40", standard_output=str(secret), standard_error=str(secret))
    slurm.job_list = [j for j in slurm.job_list if j is not own] + [fake]
    gpush = gpush_adapter(slurm, tmp_path)

    for read in ({}, {"tail": 5}, {"stream": "stderr"}):
        out = gpush.logs(7, own.job_id, **read)
        assert SECRET not in out.text and str(secret) not in out.location, read
        suffix = "err" if read.get("stream") == "stderr" else "out"
        assert (out.readable, out.location) == (False, f"{tmp_path}/logs/gpush-7.{suffix}")  # where gpush put it
    assert gpush.find(7) is None


def test_an_impostor_in_the_job_completion_log_is_neither_found_nor_read(tmp_path, secret):
    # jobcomp keeps no output path: the file is where gpush renders it, in the record's
    # working directory, which mallory chose and where she linked the broker's secret.
    home = tmp_path / "mallory"
    (home / "logs").mkdir(parents=True)
    (home / "logs" / "gpush-70.out").symlink_to(secret)
    line = jobcomp_line(77, "gpush-70", "COMPLETED", utc("2026-12-03T08:00:00"))
    jobcomp = tmp_path / "jobcomp.txt"
    mallorys = line.replace("UserId=root(0)", "UserId=mallory(1001)").replace("WorkDir=/tmp", f"WorkDir={home}")
    jobcomp.write_text(mallorys)
    slurm = recorded_2205(jobcomp=jobcomp)
    gpush = gpush_adapter(slurm, tmp_path)

    assert gpush.find(70) is None
    out = gpush.logs(70, "76")  # the Slurm job gpush recorded, which Slurm has forgotten
    assert (out.readable, out.text, out.location) == (False, "", f"{tmp_path}/logs/gpush-70.out")


def test_a_record_newer_than_the_slurm_job_gpush_recorded_is_not_the_job(tmp_path):
    slurm = recorded_2205()
    gpush = gpush_adapter(slurm, tmp_path)
    backend_id = gpush.submit(60, spec(), whole(1))
    listed = by_name(slurm.job_list)["gpush-60"]
    slurm.job_list.append(replace(listed, job_id=str(int(backend_id) + 5)))  # another broker with the same tag

    assert gpush.find(60).backend_id == backend_id
    assert {job.job_id: job.backend_id for job in gpush.statuses().jobs}[60] == backend_id


# run_as=owner: gpush user alice runs as Unix user nobody here, which every machine has.
AS_OWNER = {"run_as": "owner", "unix_users": "alice=nobody", "tenant_accounts": "ml=vision"}


def running_as_alice(tmp_path: Path, slurm: RecordedSlurm, gpush: SlurmAdapter) -> SlurmJob:
    """gpush job 60, submitted for alice, running on gpu01 and writing into ``<tmp_path>/logs``."""
    backend_id = gpush.submit(60, spec(), whole(1), Owner("alice", "ml"))
    listed = by_name(slurm.job_list)["gpush-60"]
    assert (listed.job_id, listed.user, listed.account) == (backend_id, "nobody", "vision")
    running = replace(listed, states=("RUNNING",), batch_host="gpu01", standard_output=f"{tmp_path}/logs/%x-%j.out")
    slurm.job_list = [running if j is listed else j for j in slurm.job_list]
    return running


def test_with_run_as_owner_a_job_is_known_by_the_user_and_account_gpush_submitted_it_as(tmp_path):
    slurm = recorded_2205()
    gpush = gpush_adapter(slurm, tmp_path, **AS_OWNER)
    running = running_as_alice(tmp_path, slurm, gpush)
    slurm.job_list += [
        impostor(running, "900", user="bob"),  # older, by bob, a user gpush runs jobs as too
        impostor(running, "1500", user="bob"),  # newer than the Slurm job gpush recorded
        replace(running, job_id="950", account="nlp"),  # alice's own, charged elsewhere
    ]
    out_file = tmp_path / "logs" / f"gpush-60-{running.job_id}.out"
    out_file.write_text("alice's output\n")
    os.chown(out_file, pwd.getpwnam("nobody").pw_uid, -1)  # written by her job, as her

    assert gpush.find(60).backend_id == running.job_id
    assert {job.job_id: job.backend_id for job in gpush.statuses().jobs}[60] == running.job_id
    gpush.cancel(60)
    assert slurm.cancelled == [running.job_id]
    # A broker process that did not submit it reads the Slurm job the broker recorded.
    restarted = gpush_adapter(slurm, tmp_path, **AS_OWNER)
    assert restarted.logs(60, running.job_id).text == "alice's output\n"


def test_a_held_placeholder_name_of_another_user_is_not_cancelled(tmp_path):
    slurm = recorded_2205()
    first = slurm.job_list[0]
    slurm.job_list.append(replace(first, job_id="41", name="gpush-skip", user="mallory", states=("PENDING",)))
    gpush_adapter(slurm, tmp_path).statuses()
    assert "41" not in slurm.cancelled


# -- reading: links, other files, other owners -------------------------------------------------


def writing_into(tmp_path: Path, slurm: RecordedSlurm, name: str = "gpush-7") -> SlurmJob:
    """Job ``name`` as recorded, its output files moved into ``<tmp_path>/logs`` (its log
    directory here), in the form that version keeps them (a pattern, or expanded)."""
    job = by_name(slurm.job_list)[name]
    recorded_dir = next(d for d in RECORDED_DIRS if job.standard_output.startswith(d))
    moved = replace(
        job,
        standard_output=job.standard_output.replace(recorded_dir, f"{tmp_path}/logs"),
        standard_error=(job.standard_error or job.standard_output.replace(".out", ".err")).replace(
            recorded_dir, f"{tmp_path}/logs"
        ),
    )
    slurm.job_list = [moved if j is job else j for j in slurm.job_list]
    (tmp_path / "logs").mkdir(exist_ok=True)
    return moved


@pytest.mark.parametrize("folder", [V2205, *NEWER], ids=lambda f: f.name)
def test_an_output_file_replaced_by_a_link_is_refused_not_read(tmp_path, secret, folder):
    slurm = recorded(folder)
    job = writing_into(tmp_path, slurm)
    out_file = tmp_path / "logs" / f"gpush-7-{job.job_id}.out"
    out_file.symlink_to(secret)  # what the job did: ln -sf SECRET "$its output file"
    gpush = gpush_adapter(slurm, tmp_path)

    for read in ({}, {"tail": 3}, {"offset": 5}):
        with pytest.raises(Rejected, match=f"{out_file} is a symbolic link") as refused:
            gpush.logs(7, job.job_id, **read)
        assert SECRET.strip() not in str(refused.value)


def test_a_log_directory_replaced_by_a_link_is_refused_not_read(tmp_path, secret):
    slurm = recorded_2205()
    job = writing_into(tmp_path, slurm)
    (tmp_path / "logs").rmdir()
    (secret.parent / "gpush-7-3.out").symlink_to(secret)  # any file the broker reads there
    os.link(secret, secret.parent / "gpush-7-3.err")
    (tmp_path / "logs").symlink_to(secret.parent)  # the log directory, replaced by a link
    gpush = gpush_adapter(slurm, tmp_path)

    for stream in ("stdout", "stderr"):
        with pytest.raises(Rejected, match=f"{tmp_path}/logs is a symbolic link"):
            gpush.logs(7, job.job_id, stream=stream)


def test_an_output_file_of_another_user_is_refused_not_read(tmp_path):
    # alice's job (run_as=owner): the file in her log directory belongs to someone else
    # (a hard link to their file, or one they left there).
    slurm = recorded_2205()
    gpush = gpush_adapter(slurm, tmp_path, **AS_OWNER)
    running = running_as_alice(tmp_path, slurm, gpush)
    planted = tmp_path / "logs" / f"gpush-60-{running.job_id}.out"
    planted.write_text("not alice's\n")  # the broker's own user's
    owner = pwd.getpwuid(os.geteuid()).pw_name

    with pytest.raises(Rejected, match=f"{planted}: it belongs to user {owner}, not to nobody, who ran the job"):
        gpush.logs(60, running.job_id)


def test_an_output_path_outside_the_log_directory_is_refused_not_read(tmp_path, secret):
    slurm = recorded_2205()
    job = writing_into(tmp_path, slurm)
    slurm.job_list = [
        replace(j, standard_output=str(secret)) if j.job_id == job.job_id else j for j in slurm.job_list
    ]  # as scontrol update StdOut=... would leave it
    gpush = gpush_adapter(slurm, tmp_path)

    with pytest.raises(Rejected, match=f"gpush reads job output only in the cluster's log directory {tmp_path}/logs"):
        gpush.logs(7, job.job_id)


def test_an_output_file_replaced_by_a_fifo_is_refused_at_once(tmp_path):
    slurm = recorded_2205()
    job = writing_into(tmp_path, slurm)
    fifo = tmp_path / "logs" / "gpush-7-3.out"
    os.mkfifo(fifo)  # opened for reading, it would wait for a writer for ever
    gpush = gpush_adapter(slurm, tmp_path)
    outcome: list[BaseException | object] = []

    def read() -> None:
        try:
            outcome.append(gpush.logs(7, job.job_id))
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # let the stuck reader go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not reader.is_alive() and outcome, "the read blocked on the FIFO"
    assert isinstance(outcome[0], Rejected) and f"{fifo} is not a regular file" in str(outcome[0])


def test_without_slurms_record_run_as_owner_reads_no_file_whose_owner_it_cannot_tell(tmp_path):
    slurm = recorded_2205()
    slurm.job_list = []
    gpush = gpush_adapter(slurm, tmp_path, run_as="owner")
    with pytest.raises(Rejected, match="Slurm no longer knows the job and this broker process did not submit it"):
        gpush.logs(99, "4242")
