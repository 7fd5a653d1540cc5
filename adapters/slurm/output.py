"""Reading a job's output file as ``gpush logs`` asks for it: on from a character offset,
or its last lines.

What callers may assume:

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
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import BinaryIO

_BLOCK = 1 << 20
_UNDECODABLE = re.compile("[\udc80-\udcff]")  # bytes surrogateescape kept, one per byte


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


def read_from(path: str, offset: int, *, limit: int, positions: Positions | None = None) -> Chunk:
    """The file's text from character ``offset`` on, at most ``limit`` characters. Raises
    OSError when the file cannot be opened here."""
    with open(path, "rb") as f:
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


def read_tail(path: str, lines: int, *, limit: int, positions: Positions | None = None) -> Chunk:
    """The file's last ``lines`` lines (at most ``limit`` characters of them), and the
    character offset of its end, to read on from. Raises OSError as :func:`read_from`."""
    with open(path, "rb") as f:
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
    total = _count(path, complete, positions)
    return Chunk(_readable(text), total)


def _count(path: str, up_to: int, positions: Positions | None) -> int:
    """Characters in the file's first ``up_to`` bytes (which end between two characters)."""
    with open(path, "rb") as f:
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
