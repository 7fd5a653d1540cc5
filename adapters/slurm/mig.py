"""A node's MIG layout in Slurm's own files: what gpush rewrites when a GPU is re-cut.

Slurm offers a MIG instance as a typed GRES (``gpu:3g.20gb``) whose device is the instance's
access capability, ``/dev/nvidia-caps/nvidia-capN``. The driver numbers those
(``/proc/driver/nvidia-caps/mig-minors``) as ``3 + 135 * gpu + 9 * gi`` (GPU index, GPU
instance id; broker.mig.config.mig_cap_minor), so a device file says which GPU and instance
it is. gres.conf names them in one of two styles, both read and kept as the node has them:

* ``MultipleFiles=/dev/nvidia1,/dev/nvidia-caps/nvidia-cap147,/dev/nvidia-caps/nvidia-cap148``:
  one line per instance (the GPU, its GPU- and compute-instance capabilities; Slurm 21.08+,
  what ``gpush slurm gres-conf`` writes);
* ``File=/dev/nvidia-caps/nvidia-cap147,...``: one device per file (a range like
  ``nvidia-cap[66,75]`` allowed), as the test cluster has them.

Slurm has no call to change a node's GRES counts (``scontrol update Gres=`` may only set them
to zero), so a new layout goes where an admin would put it:

* **gres.conf**: the lines that name devices of the re-cut GPU are replaced by lines for its
  new instances, each with a ``# gpush: GPU 1 3g.20gb@0`` comment naming the instance's first
  memory slot (which the device file does not say) and the GPU's old lines' other keys
  (``Cores=``, ``Links=``, ``Flags=``). Every other line is kept byte for byte (a line that
  named this GPU's devices with another's keeps the other's, re-rendered with its keys).
* **slurm.conf**: the node's ``NodeName=`` line gets the ``Gres=`` counts its gres.conf lines
  add up to; its other GRES (``mps:100``, or those a ``NodeName=DEFAULT`` line gave it) kept.

Both are written whole to a temporary file and renamed over the old one, so a reader sees the
old or the new file, never half of one. What gpush cannot rewrite alone it refuses, saying
what to change: a line naming the node with others (``NodeName=mig[01-04]``), a ``Name=gpu``
line with no ``NodeName`` (it holds for every node), a ``Count=`` with no device files, a line
continued with ``\\``, a node whose GPUs are auto-detected (``AutoDetect=nvml``: slurmd reads
its layout itself, and only slurm.conf's counts would need changing).

Then the daemons must read the files: ``scontrol reconfigure`` from Slurm 23.11 (slurmctld and
slurmd restart themselves; measured on 24.11 and 26.05), while Slurm 22.05 takes a node's new
GRES counts only when slurmctld restarts, and slurmd reads gres.conf when it starts (measured
on Debian's 22.05.8). The adapter's ``mig_reload`` names the site's command.
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
from broker.mig.config import mig_cap_minor

_CAP = re.compile(r"nvidia-cap(\d+)\Z")
_WHOLE = re.compile(r"/nvidia(\d+)\Z")
_BRACKETS = re.compile(r"^(.*?)\[([^\]]*)\](.*)$")
_MARK = re.compile(r"gpush:\s*GPU\s+(\d+)\s+(.*)$")
_DEVICE_KEYS = ("file", "multiplefiles")
# Keys of a Name=gpu line that say what the devices are; every other key (Cores=, Links=,
# Flags=) is carried over when the line is re-rendered.
_OWN_KEYS = {"nodename", "name", "type", "count", *_DEVICE_KEYS}


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
    files: tuple[str, ...]  # one (File=) or several (MultipleFiles=: the GPU, its capabilities)
    gi: int | None = None
    slot: str | None = None  # "3g.20gb@0", from gpush's comment; None where no comment says it
    extra: tuple[tuple[str, str], ...] = ()  # the line's other keys, as written (Cores=0-15)


@dataclass(frozen=True)
class _Line:
    number: int
    words: dict[str, str]  # lower-cased keys
    spelled: tuple[tuple[str, str], ...]  # the keys as written, in order
    comment: str


def _parse(line: str) -> tuple[dict[str, str], tuple[tuple[str, str], ...], str]:
    body, _, comment = line.partition("#")
    spelled = []
    for word in body.split():
        key, _, value = word.partition("=")
        spelled.append((key, value))
    return {k.lower(): v for k, v in spelled}, tuple(spelled), comment.strip()


def expand(text: str) -> list[str]:
    """Slurm's bracket ranges: ``/dev/nvidia[0,2-3]`` -> ``/dev/nvidia0``, ``2``, ``3``;
    ``a,b`` -> both. Commas inside brackets belong to the range."""
    out: list[str] = []
    for part in re.split(r",(?![^\[]*\])", text):
        match = _BRACKETS.match(part)
        if match is None:
            if part:
                out.append(part)
            continue
        for item in match[2].split(","):
            low, _, high = item.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ValueError(f"{part!r} is not a range Slurm reads")
            width = len(low) if low.startswith("0") else 0
            out += [f"{match[1]}{i:0{width}d}{match[3]}" for i in range(int(low), int(high or low) + 1)]
    return out


def _names(nodes: str, node: str, path: str, number: int) -> bool:
    """Whether ``NodeName=nodes`` is ``node`` alone; refused when it names it among others."""
    if nodes == node:
        return True
    try:
        names = expand(nodes)
    except ValueError:
        names = [nodes]
    if node in names:
        raise Rejected(
            f"{path} line {number + 1} names {node} with other nodes (NodeName={nodes}): give node {node} "
            f"lines of its own so gpush can rewrite its MIG layout"
        )
    return False


class GresConf:
    """A gres.conf's text, read for one node's GPU lines."""

    def __init__(self, text: str, path: str = "gres.conf"):
        self.text = text
        self.path = path
        self.lines = text.splitlines(keepends=True)

    def _node_lines(self, node: str) -> list[_Line]:
        """The lines that give ``node`` GPUs (refused when one cannot be rewritten)."""
        found = []
        for number, raw in enumerate(self.lines):
            words, spelled, comment = _parse(raw)
            mine = "nodename" in words and _names(words["nodename"], node, self.path, number)
            if raw.rstrip("\r\n").endswith("\\") and (mine or "nodename" not in words):
                if mine or words.get("name") == "gpu":
                    raise Rejected(
                        f"{self.path} line {number + 1} goes on to the next line (\\): write it on one line "
                        "so gpush can rewrite it"
                    )
            if words.get("autodetect", "").lower() == "nvml" and (mine or "nodename" not in words):
                raise Rejected(
                    f"{self.path} line {number + 1}: {node}'s GPUs are auto-detected (AutoDetect=nvml), so its "
                    "gres.conf lines are not gpush's to write; leave mig_gres_conf unset for this cluster"
                )
            if words.get("name") != "gpu":
                continue
            if "nodename" not in words:
                raise Rejected(
                    f"{self.path} line {number + 1} gives every node its GPUs (no NodeName=): give node {node} "
                    "Name=gpu lines of its own so gpush can rewrite its MIG layout"
                )
            if not mine:
                continue
            if not any(key in words for key in _DEVICE_KEYS):
                raise Rejected(
                    f"{self.path} line {number + 1} counts {node}'s GPUs (Count=) without naming their devices: "
                    "gpush rewrites lines with File= or MultipleFiles= (gpush slurm gres-conf NODE writes them)"
                )
            found.append(_Line(number, words, spelled, comment))
        return found

    def devices(self, node: str) -> list[GresDevice]:
        """The GPUs and MIG instances ``node``'s lines offer, in file order."""
        return [device for line in self._node_lines(node) for device in _devices(line, self.path)]

    def with_gpu(self, node: str, gpu: int, devices: Sequence[GresDevice]) -> str:
        """The text with ``node``'s GPU ``gpu`` offering ``devices`` instead (rendered as
        the node's lines have them: MultipleFiles= or File=), every other line as it was."""
        lines = self._node_lines(node)
        if not lines:
            raise Rejected(
                f"{self.path} has no Name=gpu line for node {node}: add its lines (gpush slurm gres-conf {node} "
                "prints them) so gpush can rewrite them"
            )
        touched = {line.number: _devices(line, self.path) for line in lines}
        touched = {n: ds for n, ds in touched.items() if any(d.gpu == gpu for d in ds)}
        if not touched:  # a GPU the node's lines do not name yet: its lines go after the node's last
            touched_at, rendered_old = lines[-1].number + 1, ""
        else:
            touched_at = min(touched)
            kept = [d for ds in touched.values() for d in ds if d.gpu != gpu]
            rendered_old = render_lines(node, kept)
        old_extra = next((d.extra for ds in touched.values() for d in ds if d.gpu == gpu), ())
        new = [GresDevice(d.gpu, d.type, d.files, d.gi, d.slot, d.extra or old_extra) for d in devices]
        out = []
        for number, raw in enumerate(self.lines):
            if number == touched_at:
                out.append(rendered_old + render_lines(node, new))
            if number not in touched:
                out.append(raw if raw.endswith("\n") else raw + "\n")
        if touched_at >= len(self.lines):
            out.append(rendered_old + render_lines(node, new))
        return "".join(out)

    def style(self, node: str) -> str:
        """``multiple-files`` when the node's MIG lines use MultipleFiles=, else ``file``."""
        return "multiple-files" if any("multiplefiles" in line.words for line in self._node_lines(node)) else "file"


def _devices(line: _Line, path: str) -> list[GresDevice]:
    words = line.words
    gres_type = words.get("type") or None
    extra = tuple((k, v) for k, v in line.spelled if k.lower() not in _OWN_KEYS)
    slots = _marks(line.comment)
    try:
        if "multiplefiles" in words:
            groups = [tuple(expand(words["multiplefiles"]))]
        else:
            groups = [(file,) for file in expand(words.get("file", ""))]
    except ValueError as exc:
        raise Rejected(f"{path} line {line.number + 1}: {exc}") from None
    out = []
    for files in groups:
        gpu, gi = -1, None
        for file in files:
            cap = _CAP.search(file)
            where = of_minor(int(cap[1])) if cap else None
            if where is not None:
                gpu, gi = where
            elif (whole := _WHOLE.search(file)) is not None and gpu < 0:
                gpu = int(whole[1])
        slot = slots.get((gpu, gres_type or ""), [None]).pop(0) if slots.get((gpu, gres_type or "")) else None
        out.append(GresDevice(gpu, gres_type, files, gi, slot, extra))
    return out


def _marks(comment: str) -> dict[tuple[int, str], list[str]]:
    """What gpush's comment says: (GPU, type) -> the slots of its instances, in file order."""
    match = _MARK.search(comment) if comment else None
    if match is None:
        return {}
    out: dict[tuple[int, str], list[str]] = defaultdict(list)
    for slot in match[2].split():
        out[(int(match[1]), slot.partition("@")[0])].append(slot)
    return out


def render_lines(node: str, devices: Iterable[GresDevice]) -> str:
    """The lines for ``devices``: one per device with several files (MultipleFiles=), else
    one per GPU, type and keys (File=); MIG ones with gpush's comment."""
    lines = []
    groups: dict[tuple[int, str | None, tuple], list[GresDevice]] = defaultdict(list)
    for device in devices:
        if len(device.files) > 1:
            lines.append(_line(node, device.type, f"MultipleFiles={','.join(device.files)}", device.extra, [device]))
        else:
            groups[(device.gpu, device.type, device.extra)].append(device)
    for (_, gres_type, extra), group in groups.items():
        lines.append(_line(node, gres_type, f"File={','.join(d.files[0] for d in group)}", extra, group))
    return "".join(lines)


def _line(node: str, gres_type: str | None, files: str, extra: Sequence[tuple[str, str]], group: list) -> str:
    typed = f" Type={gres_type}" if gres_type else ""
    keys = "".join(f" {k}={v}" for k, v in extra)
    line = f"NodeName={node} Name=gpu{typed} {files}{keys}"
    slots = [d.slot for d in group if d.slot]
    if slots and len(slots) == len(group):
        line += f"  # gpush: GPU {group[0].gpu} {' '.join(slots)}"
    return line + "\n"


def counts(devices: Iterable[GresDevice]) -> Counter[str | None]:
    """GRES type -> how many, as slurm.conf's ``Gres=`` must say."""
    return Counter(d.type for d in devices)


def with_node_gres(text: str, node: str, gpus: Mapping[str | None, int], path: str = "slurm.conf") -> str:
    """slurm.conf's text with ``node``'s ``Gres=`` giving ``gpus`` (type -> count) for
    ``gpu``; its other GRES (its own, or a ``NodeName=DEFAULT`` line's) kept, every other
    line as it was."""
    lines = text.splitlines(keepends=True)
    default = ""
    for number, line in enumerate(lines):
        words, _, _ = _parse(line)
        if "nodename" not in words:
            continue
        if words["nodename"].upper() == "DEFAULT":
            default = words.get("gres", default)
            continue
        if not _names(words["nodename"], node, path, number):
            continue
        if line.rstrip("\r\n").endswith("\\"):
            raise Rejected(
                f"{path} line {number + 1} (NodeName={node}) goes on to the next line (\\): write it on one line "
                "so gpush can set its Gres="
            )
        own = words.get("gres", default)
        other = [g for g in own.split(",") if g and not (g == "gpu" or g.startswith("gpu:"))]
        ours = [f"gpu:{t}:{n}" if t else f"gpu:{n}" for t, n in sorted(gpus.items(), key=lambda kv: kv[0] or "")]
        value = ",".join(ours + other)
        ending = line[len(line.rstrip("\r\n")) :]
        content = line[: len(line) - len(ending)]
        body, hash_, comment = content.partition("#")
        if re.search(r"(?i)(^|\s)Gres=\S*", body):
            body = re.sub(r"(?i)((?:^|\s)Gres=)\S*", lambda m, v=value: m[1] + v, body, count=1)
        else:
            gap = body[len(body.rstrip()) :] or (" " if hash_ else "")
            body = f"{body.rstrip()} Gres={value}{gap}"
        lines[number] = body + hash_ + comment + ending
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


def mig_devices(
    gpu: int,
    caps_dir: str,
    slots: Sequence[str],
    instances: Mapping[str, tuple[int, int | None]],
    *,
    style: str = "file",
    gpu_device: str | None = None,
) -> list[GresDevice]:
    """The devices a GPU cut as ``slots`` offers; ``instances``: slot -> (GPU instance id,
    compute instance id), from the node agent's report. ``multiple-files`` names the GPU's
    device (``gpu_device``) and both capabilities, ``file`` the GPU instance's alone."""
    out = []
    for slot in slots:
        if slot not in instances:
            raise Rejected(f"the node agent does not report the instance {slot} on GPU {gpu}")
        gi, ci = instances[slot]
        files = [f"{caps_dir}/nvidia-cap{mig_cap_minor(gpu, gi)}"]
        if style == "multiple-files":
            if ci is None:
                raise Rejected(f"instance {slot} of GPU {gpu} has no compute instance yet (the agent reports none)")
            files = [gpu_device or f"/dev/nvidia{gpu}", files[0], f"{caps_dir}/nvidia-cap{mig_cap_minor(gpu, gi, ci)}"]
        out.append(GresDevice(gpu, slot.partition("@")[0], tuple(files), gi, slot))
    return out
