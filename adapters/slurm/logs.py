"""A Slurm job's output for ``gpush logs`` (the guarantees: "Output" in
adapters.slurm.adapter's docstring): which file holds a job's stdout or stderr and on
which node, read through adapters.slurm.output where the broker sees it; and the jobs'
log directory, made before a submission."""

from __future__ import annotations

import logging
import os
import posixpath
import pwd

from adapters.slurm.context import SlurmContext
from adapters.slurm.output import Positions, read_from, read_tail
from adapters.slurm.records import PENDING_STATES as _PENDING
from adapters.slurm.render import expand_filename, job_id_of, log_directory, log_paths
from broker.core.adapter import MAX_LOG_CHUNK, JobOutput, Rejected

_log = logging.getLogger(__name__)


class JobLogs:
    """The output files of one Slurm cluster's gpush jobs (LogReader)."""

    def __init__(self, ctx: SlurmContext):
        self.ctx = ctx
        self._positions = Positions()  # where the offsets ``logs`` handed out lie in their files
        self._log_dirs_refused: set[str] = set()  # log directories the broker could not create (said once)

    def logs(
        self,
        job_id: int,
        backend_id: str,
        *,
        stream: str = "stdout",
        replica: int | None = None,
        offset: int = 0,
        tail: int | None = None,
    ) -> JobOutput:
        """Job ``job_id``'s stdout or stderr (see adapters.slurm.adapter's docstring), read
        here when the broker can see the file, else where it is."""
        if stream not in ("stdout", "stderr"):
            raise Rejected(f"a Slurm job has two streams, stdout and stderr; not {stream!r}")
        if replica not in (None, 0):
            raise Rejected(f"job {job_id} is one Slurm job on {self.ctx.name}: it has no replica {replica}")
        if offset < 0 or (tail is not None and tail < 0):
            raise Rejected("offset and tail count from 0")
        path, node, note = self._output_file(job_id, backend_id, stream)
        location = f"node {node}: {path}" if node else path
        try:
            if tail is not None:
                chunk = read_tail(path, tail, limit=MAX_LOG_CHUNK, positions=self._positions)
            else:
                chunk = read_from(path, offset, limit=MAX_LOG_CHUNK, positions=self._positions)
        except OSError as exc:
            why = "is not there" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc.strerror})"
            if node:
                where = f"it is on {node}'s own disk: read it there (ssh {node} tail -f {path})"
            else:
                where = f"Slurm no longer says which node ran job {job_id}: read it on that node"
            return JobOutput(
                location,
                next_offset=offset,
                readable=False,
                note=f"{path} {why} on the broker's machine; {where}, or set the cluster's log_dir "
                "to a directory on a filesystem the broker shares with the nodes",
            )
        if chunk.shorter:
            note = (
                f"{note}; " if note else ""
            ) + f"the output is shorter than offset {offset}: Slurm ran the job again, and its files began anew"
        return JobOutput(location, chunk.text, chunk.next_offset, note=note)

    def _output_file(self, job_id: int, backend_id: str, stream: str) -> tuple[str, str | None, str | None]:
        """(path, node, note) of the job's ``stream``: the file Slurm names for it (squeue, else
        accounting), else the one gpush rendered. :class:`Rejected` when it never started."""
        records = self.ctx.tagged(self.ctx.jobs(fresh=True)).get(job_id, [])
        job = next((r for r in records if r.job_id == backend_id), None) or self.ctx.real(records)
        if job is not None:
            node = job.batch_host or job.nodes or None
            if job.state in _PENDING and not job.restarts:
                raise Rejected(f"job {job_id} has not started on {self.ctx.name} yet: no output")
            if node is None and not job.restarts:
                raise Rejected(f"job {job_id} never started on {self.ctx.name}: no output")
            pattern, note = job.standard_error if stream == "stderr" else job.standard_output, None
            if stream == "stderr" and not pattern and job.standard_output:
                pattern, note = job.standard_output, "Slurm writes this job's stderr into its stdout file"
            if pattern:
                path = expand_filename(pattern, job_id=job.job_id, name=job.name, user=job.user, node=node or "")
                return posixpath.join(job.work_dir or self.ctx.settings.workdir, path), node, note
            return self._rendered_output(job_id, stream, job.user, job.work_dir), node, None
        finished = [r for r in self.ctx.client.finished(None) if job_id_of(self.ctx.settings.tag, r.name) == job_id]
        record = next((r for r in finished if r.job_id == backend_id), None) or (finished or [None])[-1]
        if record is not None:
            node = record.nodes if record.nodes not in ("", "None assigned", "(null)") else None
            if node is None:
                raise Rejected(f"job {job_id} never started on {self.ctx.name}: no output")
            pattern = record.standard_error if stream == "stderr" else record.standard_output
            if pattern:
                path = expand_filename(pattern, job_id=record.job_id, name=record.name, user=record.user, node=node)
                return posixpath.join(record.work_dir or self.ctx.settings.workdir, path), node, None
            return self._rendered_output(job_id, stream, record.user, record.work_dir), node, None
        # Slurm has forgotten it: where gpush told it to write.
        return self._rendered_output(job_id, stream, None), None, None

    def _rendered_output(self, job_id: int, stream: str, user: str | None, workdir: str = "") -> str:
        """The file gpush asked Slurm for (``workdir``: the one the job ran in, when known)."""
        settings = self.ctx.settings
        out, err = log_paths(workdir or settings.workdir, settings.log_dir, settings.tag, job_id)
        return (err if stream == "stderr" else out).replace("%u", user or self.ctx.slurm_user())

    def make_log_dir(self, user: str | None = None) -> None:
        """Create the log directory before a submission: Slurm creates none, and a job whose
        ``--output`` directory is missing fails at launch (JobLaunchFailure, Slurm 22.05).
        Made here, it is the nodes' directory when the broker shares their filesystem or is
        their machine; a broker elsewhere needs a ``log_dir`` the site made on the nodes."""
        settings = self.ctx.settings
        per_user = "%u" in settings.log_dir
        directory = log_directory(settings.workdir, settings.log_dir).replace("%u", user or self.ctx.slurm_user())
        if os.path.isdir(directory):
            return
        try:
            os.makedirs(directory, exist_ok=True)
            if user is not None:
                # Jobs that run as their users write here: a user's own directory is
                # theirs, one shared by users is like /tmp (anyone writes, only the owner
                # of a file removes it).
                if per_user and os.geteuid() == 0:
                    os.chown(directory, pwd.getpwnam(user).pw_uid, -1)
                elif not per_user:
                    os.chmod(directory, 0o1777)
        except (OSError, KeyError) as exc:
            if directory not in self._log_dirs_refused:
                self._log_dirs_refused.add(directory)
                _log.warning(
                    "%s: cannot create the jobs' log directory %s here (%s): jobs fail at launch unless it "
                    "exists on the nodes (set log_dir to a directory of a filesystem the nodes share)",
                    self.ctx.name,
                    directory,
                    getattr(exc, "strerror", None) or exc,
                )
