"""A node's MIG layout in Slurm's own files: what gpush rewrites when a GPU is re-cut.

Slurm offers a MIG instance as a typed GRES (``gpu:3g.20gb``) whose ``File=`` is the
instance's access capability device, ``/dev/nvidia-caps/nvidia-capN``. The driver numbers
those (``/proc/driver/nvidia-caps/mig-minors``) as ``3 + 135 * gpu + 9 * gi``: GPU index
and GPU instance id, so a ``File=`` says which GPU and instance it is. Slurm has no call to
change a node's GRES counts (``scontrol update Gres=`` may only set them to zero), so a new
layout goes where an admin would put it:

* **gres.conf**: the node's ``Name=gpu`` lines are rewritten, one line per GPU and type,
  with a ``# gpush: GPU 1 3g.20gb@0 ...`` comment naming each instance's first memory
  slot (which the device file does not say). The node's other lines (``mps``, other
  nodes', comments) are kept byte for byte.
* **slurm.conf**: the node's ``NodeName=`` line gets the ``Gres=`` counts the new
  gres.conf adds up to; its other GRES (``mps:100``) are kept.

Both are written whole to a temporary file and renamed over the old one, so a reader sees
the old or the new file, never half of one. What gpush cannot rewrite alone, it refuses
with what to change instead: a line naming the node with others (``NodeName=mig[01-04]``)
or a ``Name=gpu`` line with no ``NodeName`` (it holds for every node).

Then the daemons must read the files: ``scontrol reconfigure`` on Slurm 23.11 and later
(slurmctld and slurmd restart themselves), while Slurm 22.05 takes a node's new GRES counts
only when slurmctld restarts and the node's slurmd re-reads gres.conf when it restarts
(measured on Debian's 22.05.8; 24.11 and 26.05 take both at ``scontrol reconfigure``; the adapter's
``mig_reload`` names the site's command).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from broker.core.adapter import Rejected

_CAP = re.compile(r"nvidia-cap(\d+)\Z")
_WHOLE = re.compile(r"/nvidia(\d+)\Z")
_RANGE = re.compile(r"^(.*)\[(\d+)-(\d+)\](.*)$")
_MARK = re.compile(r"#\s*gpush:\s*GPU\s+(\d+)\s+(.*)$")
_MIG_TYPE = re.compile(r"^\d+g\.\d+gb\Z")


def cap_minor(gpu: int, gi: int) -> int:
    """The minor number of GPU instance ``gi`` of GPU ``gpu``'s access capability."""
    return 3 + 135 * gpu + 9 * gi


def of_minor(minor: int) -> tuple[int, int] | None:
    """(GPU index, GPU instance id) of a MIG access capability's minor, or None when the
    minor is not a GPU instance's access (a compute instance's, the config's)."""
    rest = minor - 3
    if rest < 0 or rest % 9:
        return None
    return rest // 135, (rest % 135) // 9


@dataclass(frozen=True)
class GresDevice:
    """One device a node's ``Name=gpu`` lines offer: GPU ``gpu`` whole, or its MIG instance ``gi``."""

    gpu: int
    type: str | None
    file: str
    gi: int | None = None
    slot: str | None = None  # "3g.20gb@0", from gpush's comment; None where no comment says it


def _words(line: str) -> tuple[dict[str, str], str]:
    """``Key=value`` words of a config line (keys lower-cased) and its comment."""
    body, _, comment = line.partition("#")
    words = {}
    for word in body.split():
        key, _, value = word.partition("=")
        words[key.lower()] = value
    return words, comment


def _expand(files: str) -> list[str]:
    """``/dev/nvidia[0-1],/dev/x`` -> every file named (Slurm's bracket ranges)."""
    out = []
    for part in files.split(","):
        match = _RANGE.match(part)
        if match is None:
            out.append(part)
            continue
        low, high = int(match[2]), int(match[3])
        width = len(match[2]) if match[2].startswith("0") else 0
        out += [f"{match[1]}{i:0{width}d}{match[4]}" for i in range(low, high + 1)]
    return out


def _names_only(nodes: str, node: str) -> bool | None:
    """True when ``NodeName=nodes`` is exactly ``node``; False when it is other nodes
    only; None when it names ``node`` among others (or a range that may hold it)."""
    if nodes == node:
        return True
    if "[" in nodes or "," in nodes:
        names = set()
        for part in re.split(r",(?![^\[]*\])", nodes):
            names.update(_expand(part) if "[" in part and "-" in part else [part])
        return None if node in names or any("[" in n for n in names) else False
    return False


class GresConf:
    """A gres.conf's text, read for one node's GPU lines."""

    def __init__(self, text: str, path: str = "gres.conf"):
        self.text = text
        self.path = path
        self.lines = text.splitlines(keepends=True)

    def _gpu_lines(self, node: str) -> list[int]:
        """Indexes of the lines that give ``node`` GPUs (refused when one cannot be rewritten)."""
        found = []
        for number, line in enumerate(self.lines):
            words, _ = _words(line)
            if words.get("name") != "gpu":
                continue
            if "nodename" not in words:
                raise Rejected(
                    f"{self.path} line {number + 1} gives every node its GPUs (no NodeName=): give node {node} "
                    f"Name=gpu lines of its own so gpush can rewrite its MIG layout"
                )
            holds = _names_only(words["nodename"], node)
            if holds is None:
                raise Rejected(
                    f"{self.path} line {number + 1} names {node} with other nodes (NodeName={words['nodename']}): "
                    f"give node {node} Name=gpu lines of its own so gpush can rewrite its MIG layout"
                )
            if holds:
                found.append(number)
        return found

    def devices(self, node: str) -> list[GresDevice]:
        """The GPUs and MIG instances ``node``'s lines offer, in file order."""
        out = []
        for number in self._gpu_lines(node):
            words, comment = _words(self.lines[number])
            marks = _marks(comment)
            for file in _expand(words.get("file", "")):
                out.append(_device(file, words.get("type") or None, marks))
        return out

    def with_gpu(self, node: str, gpu: int, devices: Sequence[GresDevice]) -> str:
        """The text with ``node``'s GPU ``gpu`` offering ``devices`` instead; its other
        GPUs' devices and every other line as they were."""
        numbers = self._gpu_lines(node)
        kept = [d for d in self.devices(node) if d.gpu != gpu]
        if not numbers:
            raise Rejected(f"{self.path} has no Name=gpu line for node {node}: gpush rewrites only nodes it lists")
        rendered = render_lines(node, [*kept, *devices])
        first = numbers[0]
        out = [line for i, line in enumerate(self.lines) if i not in numbers[1:]]
        out[first] = rendered
        return "".join(out)


def _marks(comment: str) -> dict[tuple[int, str], list[str]]:
    """What gpush's comment says: (GPU, type) -> the slots of its instances, in file order."""
    match = _MARK.search("#" + comment) if comment else None
    if match is None:
        return {}
    out: dict[tuple[int, str], list[str]] = defaultdict(list)
    for slot in match[2].split():
        profile = slot.partition("@")[0]
        out[(int(match[1]), profile)].append(slot)
    return out


def _device(file: str, gres_type: str | None, marks: Mapping[tuple[int, str], list[str]]) -> GresDevice:
    cap = _CAP.search(file)
    if cap is not None and (where := of_minor(int(cap[1]))) is not None:
        gpu, gi = where
        slots = marks.get((gpu, gres_type or ""), [])
        return GresDevice(gpu, gres_type, file, gi, slots.pop(0) if slots else None)
    whole = _WHOLE.search(file)
    return GresDevice(int(whole[1]) if whole else -1, gres_type, file)


def render_lines(node: str, devices: Iterable[GresDevice]) -> str:
    """One ``Name=gpu`` line per GPU and type, the MIG ones with gpush's comment."""
    groups: dict[tuple[int, str | None], list[GresDevice]] = defaultdict(list)
    for device in devices:
        groups[(device.gpu, device.type)].append(device)
    lines = []
    for (gpu, gres_type), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        typed = f" Type={gres_type}" if gres_type else ""
        line = f"NodeName={node} Name=gpu{typed} File={','.join(d.file for d in group)}"
        slots = [d.slot for d in group if d.slot]
        if slots and len(slots) == len(group):
            line += f"  # gpush: GPU {gpu} {' '.join(slots)}"
        lines.append(line + "\n")
    return "".join(lines)


def counts(devices: Iterable[GresDevice]) -> Counter[str | None]:
    """GRES type -> how many, as slurm.conf's ``Gres=`` must say."""
    return Counter(d.type for d in devices)


def with_node_gres(text: str, node: str, gpus: Mapping[str | None, int], path: str = "slurm.conf") -> str:
    """slurm.conf's text with ``node``'s ``Gres=`` giving ``gpus`` (type -> count) for
    ``gpu``; its other GRES kept, every other line as it was."""
    lines = text.splitlines(keepends=True)
    for number, line in enumerate(lines):
        words, _ = _words(line)
        if "nodename" not in words:
            continue
        holds = _names_only(words["nodename"], node)
        if holds is None:
            raise Rejected(
                f"{path} line {number + 1} defines {node} with other nodes (NodeName={words['nodename']}): "
                f"give node {node} a NodeName line of its own so gpush can set its GRES"
            )
        if not holds:
            continue
        other = [g for g in words.get("gres", "").split(",") if g and not (g == "gpu" or g.startswith("gpu:"))]
        ours = [f"gpu:{t}:{n}" if t else f"gpu:{n}" for t, n in sorted(gpus.items(), key=lambda kv: kv[0] or "")]
        value = ",".join(ours + other)
        body, hash_, comment = line.partition("#")
        ending = "\n" if line.endswith("\n") else ""
        body = body.rstrip("\n")
        if re.search(r"(?i)(^|\s)Gres=\S*", body):
            body = re.sub(r"(?i)((?:^|\s)Gres=)\S*", lambda m, v=value: m[1] + v, body, count=1)
        else:
            body = body.rstrip() + f" Gres={value}"
        lines[number] = body + (hash_ + comment.rstrip("\n") if hash_ else "") + ending
        return "".join(lines)
    raise Rejected(f"{path} has no NodeName line for {node}")


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it (same mode)."""
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def mig_devices(gpu: int, caps_dir: str, slots: Sequence[str], gi_of: Mapping[str, int]) -> list[GresDevice]:
    """The devices a GPU cut as ``slots`` offers, its instances' ids from ``gi_of``
    (slot -> GPU instance id, the node agent's report)."""
    out = []
    for slot in slots:
        if slot not in gi_of:
            raise Rejected(f"the node agent does not report the instance {slot} on GPU {gpu}")
        gi = gi_of[slot]
        out.append(GresDevice(gpu, slot.partition("@")[0], f"{caps_dir}/nvidia-cap{cap_minor(gpu, gi)}", gi, slot))
    return out


def is_mig_type(gres_type: str | None) -> bool:
    return bool(gres_type and _MIG_TYPE.match(gres_type))
