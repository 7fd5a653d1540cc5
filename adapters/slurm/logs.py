"""A Slurm job's output for ``gpush logs`` (the guarantees: "Output" in
adapters.slurm.adapter's docstring): which file holds a job's stdout or stderr and on
which node, read through adapters.slurm.output where the broker sees it; and the jobs'
log directory, made before a submission.

What is read is the job's own and nothing else, whatever the job or another Slurm user
did to its files:

- the file of the Slurm job the broker recorded for it (``backend_id``), found among the
  records gpush takes for its own (adapters.slurm.context: never an impostor's record,
  whose output path would be the impostor's choice);
- only in the job's log directory (``log_dir``, ``%u`` its user's), reached without
  following a symbolic link anywhere on the way (adapters.slurm.output.open_output);
- only a regular file that the job's user owns.

Anything else is refused (:class:`Rejected`, which the API answers with 409) saying why,
never with the file's content."""

from __future__ import annotations

import logging
import os
import posixpath
import pwd
from typing import BinaryIO, NamedTuple

from adapters.slurm.context import SlurmContext
from adapters.slurm.output import OutputRefused, Positions, open_output, read_from, read_tail
from adapters.slurm.records import PENDING_STATES as _PENDING
from adapters.slurm.render import expand_filename, log_directory, log_paths
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
            raise Rejected(
                f"job {job_id} is one Slurm job on {self.ctx.name} with one output file, every rank's lines in it "
                f"(srun gathers them): it has no replica or rank {replica} of its own; `gpush logs {job_id}` reads "
                "them all"
            )
        if offset < 0 or (tail is not None and tail < 0):
            raise Rejected("offset and tail count from 0")
        path, node, note, user = self._output_file(job_id, backend_id, stream)
        location = f"node {node}: {path}" if node else path
        try:
            with self._open(job_id, stream, path, user) as f:
                if tail is not None:
                    chunk = read_tail(f, tail, limit=MAX_LOG_CHUNK, positions=self._positions)
                else:
                    chunk = read_from(f, offset, limit=MAX_LOG_CHUNK, positions=self._positions)
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

    def _open(self, job_id: int, stream: str, path: str, user: str | None) -> BinaryIO:
        """Job ``job_id``'s ``stream`` file at ``path``, open, if it is the job's own (see the
        module docstring); :class:`Rejected` saying why not; OSError where it cannot be reached."""
        refused = f"job {job_id}'s {stream} is not read from {path}"
        if user is None:
            raise Rejected(
                f"{refused}: Slurm no longer knows the job and this broker process did not submit it, so "
                f"gpush cannot tell whose file it is; read it on {self.ctx.name} as the job's user"
            )
        directory = self._log_directory(user)
        if posixpath.dirname(path) != directory:
            raise Rejected(
                f"{refused}: gpush reads job output only in the cluster's log directory {directory} "
                "(log_dir; was it changed since the job was submitted?)"
            )
        try:
            f = open_output(path)
        except OutputRefused as exc:
            raise Rejected(f"{refused}: {exc}; gpush reads only a regular file the job's user owns") from None
        try:
            owner = os.fstat(f.fileno()).st_uid
            if owner != _uid(user):
                raise Rejected(f"{refused}: it belongs to {_user_name(owner)}, not to {user}, who ran the job")
        except BaseException:
            f.close()
            raise
        return f

    def _output_file(self, job_id: int, backend_id: str, stream: str) -> _Output:
        """Where the job's ``stream`` is: the file Slurm names for the Slurm job ``backend_id``
        (squeue, else accounting), else the one gpush rendered; on which node; and the user
        whose file it is (None: not known). :class:`Rejected` when it never started."""
        records = self.ctx.tagged(self.ctx.jobs(fresh=True)).get(job_id, [])
        job = next((r for r in records if r.job_id == backend_id), None)
        if job is None and not backend_id:  # a caller with no Slurm id: the job gpush took for it
            job = self.ctx.real(records)
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
                return _Output(self._absolute(path, job.work_dir), node, note, job.user)
            return _Output(self._rendered_output(job_id, stream, job.user), node, None, job.user)
        finished = [r for r in self.ctx.client.finished(None) if self.ctx.gpush_id(r) == job_id]
        record = next((r for r in finished if r.job_id == backend_id), None)
        if record is None and not backend_id:
            record = (finished or [None])[-1]
        if record is not None:
            node = record.nodes if record.nodes not in ("", "None assigned", "(null)") else None
            if node is None:
                raise Rejected(f"job {job_id} never started on {self.ctx.name}: no output")
            pattern = record.standard_error if stream == "stderr" else record.standard_output
            if pattern:
                path = expand_filename(pattern, job_id=record.job_id, name=record.name, user=record.user, node=node)
                return _Output(self._absolute(path, record.work_dir), node, None, record.user)
            return _Output(self._rendered_output(job_id, stream, record.user), node, None, record.user)
        # Slurm has forgotten it: where gpush told it to write, as whom gpush submitted it.
        user = self._submitted_user(job_id)
        return _Output(self._rendered_output(job_id, stream, user), None, None, user)

    def _submitted_user(self, job_id: int) -> str | None:
        """The Slurm user job ``job_id`` runs as, where gpush knows it without Slurm."""
        with self.ctx.lock:
            submitted = self.ctx.submitted_as.get(job_id)
        if submitted is not None:
            return submitted[0]
        return self.ctx.slurm_user() if self.ctx.settings.run_as == "service" else None

    def _absolute(self, path: str, workdir: str) -> str:
        """A path Slurm reports (relative ones are in the job's working directory), normalised."""
        return posixpath.normpath(posixpath.join(workdir or self.ctx.settings.workdir, path))

    def _log_directory(self, user: str) -> str:
        """Where ``user``'s jobs write their output (``log_dir``; %u expanded), as gpush rendered it."""
        settings = self.ctx.settings
        return log_directory(settings.workdir, settings.log_dir).replace("%u", user)

    def _rendered_output(self, job_id: int, stream: str, user: str | None) -> str:
        """The file gpush asked Slurm for (``%u`` kept where the user is not known)."""
        settings = self.ctx.settings
        out, err = log_paths(settings.workdir, settings.log_dir, settings.tag, job_id)
        path = err if stream == "stderr" else out
        return path.replace("%u", user) if user else path

    def make_log_dir(self, user: str | None = None) -> None:
        """Create the log directory before a submission: Slurm creates none, and a job whose
        ``--output`` directory is missing fails at launch (JobLaunchFailure, Slurm 22.05).
        Made here, it is the nodes' directory when the broker shares their filesystem or is
        their machine; a broker elsewhere needs a ``log_dir`` the site made on the nodes."""
        settings = self.ctx.settings
        per_user = "%u" in settings.log_dir
        directory = self._log_directory(user or self.ctx.slurm_user())
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


class _Output(NamedTuple):
    """Where a job's stream is, and whose file it is (None: not known)."""

    path: str
    node: str | None
    note: str | None
    user: str | None


def _uid(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:  # no such user here: no file here is theirs
        return None


def _user_name(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"
