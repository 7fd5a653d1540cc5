"""The files a command is handed by name (a job, policy or fleet file; ``-`` for stdin),
read with errors that name the file: shared by the command modules that take one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from broker.core.errors import InvalidRequest


def read_job_file(path: str, stdin_text: Callable[[], str], *, what: str = "job file") -> str:
    """The text of ``path`` (``-``: stdin); ``what`` names the file in errors (policy file, fleet file)."""
    if path == "-":
        return stdin_text()
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise InvalidRequest(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"cannot read {what} {path}: {exc}") from None
