"""Reading a job's output file as ``gpush logs`` asks for it: on from a character offset,
or its last lines.

What callers may assume:

- **No link is followed** (:func:`open_output`). A job may replace its output file, or a
  directory on its way, with a symbolic link to a file only the broker may read; the
  path is opened one component at a time, each relative to the directory before it and
  none through a link, and only a regular file is read (a FIFO would block the reader, a
  device never ends). Whose file it is, is the caller's to check, on the open file.

- **Offsets count characters**, as :class:`broker.core.adapter.JobOutput` does: UTF-8, a
  byte that is not UTF-8 counting as one character (shown as U+FFFD). A character whose
  bytes are not all written yet (a growing file) is left for the next read, so
  ``next_offset`` always falls between two characters.
- **Bounded reads.** A read returns at most ``limit`` characters; ``tail`` reads blocks
  back from the end until it has its lines (at most ``limit`` characters of them), never
  the whole file into memory.
- **Cheap following.** :class:`Positions` remembers at which byte each offset it handed
  out lies, so ``gpush logs -f`` reads on from there instead of decoding the file from
  its start at every poll. Only an offset it has not seen (another broker process gave
  it out) or a tail's ``next_offset`` is counted from the top, block by block.
"""

from __future__ import annotations

import codecs
import errno
import os
import posixpath
import re
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import BinaryIO

_BLOCK = 1 << 20
_UNDECODABLE = re.compile("[\udc80-\udcff]")  # bytes surrogateescape kept, one per byte
# Each directory on the way: O_PATH where there is one (Linux), so a directory that may be
# searched but not listed (a home at 0711) can still be passed.
_DIRECTORY = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_PATH", os.O_RDONLY)
# The file: never blocking on a FIFO, never taking a terminal.
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class OutputRefused(Exception):
    """The path leads through a symbolic link, or to something that is not a regular file."""


def open_output(path: str) -> BinaryIO:
    """The file at absolute ``path``, open for reading, reached without following a link
    (see the module docstring). Raises :class:`OutputRefused` for a link or a file that
    is not regular, and OSError as ``open`` would where the file cannot be reached."""
    if not posixpath.isabs(path):
        raise OutputRefused(f"{path} is not an absolute path")
    parts = [p for p in posixpath.normpath(path).split("/") if p]
    if not parts:
        raise OutputRefused(f"{path} is not a file")
    at = os.open("/", _DIRECTORY)
    try:
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            try:
                fd = os.open(part, _FILE if last else _DIRECTORY, dir_fd=at)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and _is_link(part, at):
                    raise OutputRefused(f"{'/' + '/'.join(parts[: depth + 1])} is a symbolic link") from None
                raise
            os.close(at)
            at = fd
        mode = os.fstat(at).st_mode
        if not stat.S_ISREG(mode):
            raise OutputRefused(f"{'/' + '/'.join(parts)} is not a regular file")
        os.set_blocking(at, True)
        f = os.fdopen(at, "rb")
        at = -1  # the file object owns it now
        return f
    finally:
        if at >= 0:
            os.close(at)


def _is_link(name: str, directory: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=directory).st_mode)
    except OSError:
        return False


@dataclass(frozen=True)
class Chunk:
    text: str
    next_offset: int
    shorter: bool = False  # the file has fewer characters than the offset asked for


class Positions:
    """Byte positions of character offsets already handed out, per file (device, inode).

    Bounded: the files most recently read, a few positions each. Safe across threads
    (the API serves several ``gpush logs`` at once)."""

    def __init__(self, files: int = 256, per_file: int = 16):
        self._files: OrderedDict[tuple[int, int], OrderedDict[int, int]] = OrderedDict()
        self._max_files, self._per_file = files, per_file
        self._lock = threading.Lock()

    def nearest(
        self, key: tuple[int, int], size: int, *, chars: int | None = None, byte: int | None = None
    ) -> tuple[int, int]:
        """(characters, bytes) of the known position furthest into the file at or before
        ``chars`` characters and ``byte`` bytes; (0, 0) when none is. Positions beyond
        ``size`` are forgotten: the file was started afresh (Slurm ran the job again)."""
        with self._lock:
            known = self._files.get(key)
            if not known:
                return 0, 0
            self._files.move_to_end(key)
            if any(b > size for b in known.values()):
                known.clear()
                return 0, 0
            fits = [(c, b) for c, b in known.items() if (chars is None or c <= chars) and (byte is None or b <= byte)]
            return max(fits, default=(0, 0))

    def remember(self, key: tuple[int, int], chars: int, byte: int) -> None:
        with self._lock:
            known = self._files.setdefault(key, OrderedDict())
            self._files.move_to_end(key)
            known[chars] = byte
            known.move_to_end(chars)
            while len(known) > self._per_file:
                known.popitem(last=False)
            while len(self._files) > self._max_files:
                self._files.popitem(last=False)


def read_from(f: BinaryIO, offset: int, *, limit: int, positions: Positions | None = None) -> Chunk:
    """The open file's text from character ``offset`` on, at most ``limit`` characters."""
    key, size = _identity(f)
    start_chars, start_byte = positions.nearest(key, size, chars=offset) if positions else (0, 0)
    f.seek(start_byte)
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    read = consumed = start_byte  # bytes read; bytes turned into characters
    chars = start_chars  # characters before ``consumed``
    pieces: list[str] = []
    taken = 0
    while taken <= limit:
        block = f.read(_BLOCK)
        if not block:
            break
        read += len(block)
        text = decoder.decode(block)
        consumed = read - len(decoder.getstate()[0])
        before, chars = chars, chars + len(text)
        if chars <= offset:
            continue
        if before < offset:
            text = text[offset - before :]
        pieces.append(text)
        taken += len(text)
    if chars < offset:
        # Fewer characters than the caller read before: the file started over.
        if positions:
            positions.remember(key, chars, consumed)
        return Chunk("", chars, shorter=True)
    text = "".join(pieces)
    end_byte = consumed
    if len(text) > limit:
        end_byte -= len(text[limit:].encode("utf-8", "surrogateescape"))
        text = text[:limit]
    next_offset = offset + len(text)
    if positions:
        positions.remember(key, next_offset, end_byte)
    return Chunk(_readable(text), next_offset)


def read_tail(f: BinaryIO, lines: int, *, limit: int, positions: Positions | None = None) -> Chunk:
    """The open file's last ``lines`` lines (at most ``limit`` characters of them), and
    the character offset of its end, to read on from."""
    key, size = _identity(f)
    # A character still being written at the end stays out, as in read_from.
    f.seek(max(0, size - 4))
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    decoder.decode(f.read())
    end = size - len(decoder.getstate()[0])
    complete = end
    data = b""
    # Back from the end, a block at a time, until the lines are there: ``lines``
    # newlines before the last byte (those of all but the last line, and the one that
    # ends the line before them), or more bytes than ``limit`` characters need.
    while end > 0 and data.count(b"\n", 0, max(len(data) - 1, 0)) < lines and len(data) <= 4 * limit:
        start = max(0, end - _BLOCK)
        f.seek(start)
        data = f.read(end - start) + data
        end = start
    whole = _lines(data.decode("utf-8", "surrogateescape"))
    if end > 0 and whole:
        whole = whole[1:]  # begins mid-line (maybe mid-character): never one of the last lines
    text = "".join(whole[-lines:]) if lines else ""
    text = text[-limit:]
    total = _count(f, complete, positions)
    return Chunk(_readable(text), total)


def _count(f: BinaryIO, up_to: int, positions: Positions | None) -> int:
    """Characters in the open file's first ``up_to`` bytes (which end between two characters)."""
    key, size = _identity(f)
    chars, byte = positions.nearest(key, size, byte=up_to) if positions else (0, 0)
    f.seek(byte)
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    while byte < up_to:
        block = f.read(min(_BLOCK, up_to - byte))
        if not block:
            break
        byte += len(block)
        chars += len(decoder.decode(block))
    # ``up_to`` ends between two characters: bytes still held end in one that is not UTF-8.
    chars += len(decoder.decode(b"", final=True))
    if positions:
        positions.remember(key, chars, byte)
    return chars


def _lines(text: str) -> list[str]:
    """``text`` cut after each newline: only a newline ends a line (a progress bar's
    carriage return does not, as ``str.splitlines`` would have it)."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _identity(f: BinaryIO) -> tuple[tuple[int, int], int]:
    st = os.fstat(f.fileno())
    return (st.st_dev, st.st_ino), st.st_size


def _readable(text: str) -> str:
    """Bytes that are not UTF-8 as U+FFFD, one character each (so offsets still add up)."""
    return _UNDECODABLE.sub("\ufffd", text)
