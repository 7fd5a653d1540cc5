"""Publishing a GPU's new MIG layout to Slurm (MigPublisher): the node's lines in
``mig_gres_conf`` and its ``Gres=`` in slurm.conf rewritten (adapters.slurm.mig renders
them), then ``mig_reload`` run so that slurmctld and the node's slurmd read them; and
reading back whether Slurm offers the layout yet."""

from __future__ import annotations

import os
import posixpath
import re
import shlex
import subprocess
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adapters.slurm.context import SlurmContext
from adapters.slurm.mig import GresConf, mig_devices, replace_file, with_node_gres
from adapters.slurm.mig import counts as gres_counts
from adapters.slurm.nodes import NodeFencing
from broker.core.adapter import Misconfigured, Rejected, Unreachable


class MigGresPublisher:
    """MIG layouts in one Slurm cluster's gres.conf and slurm.conf (see the module docstring)."""

    def __init__(self, ctx: SlurmContext, nodes: NodeFencing):
        self.ctx = ctx
        self.nodes = nodes

    def publish_mig(self, node: str, gpu: int, instances: Sequence[str], reported: Any = None) -> None:
        """Offer GPU ``gpu`` of ``node`` as ``instances`` once its agent ``reported`` them:
        the node's ``Name=gpu`` lines in ``mig_gres_conf`` name each instance's device
        (from the GPU instance ids the agent reports), the node's ``Gres=`` in slurm.conf
        adds them up, and ``mig_reload`` makes the daemons read both. Rewriting what is
        written already changes nothing; the reload runs again while slurmctld still
        offers other counts than the files (a reload that failed is retried)."""
        gres_path, slurm_path = self._mig_files()
        busy = self.nodes.busy(node)
        if busy:
            raise Unreachable(f"node {node} still runs jobs ({busy}): Slurm aborts them when its GRES change")
        if reported is None:
            raise Rejected(
                f"Slurm takes a MIG layout from the node agent's report of the instances, and node {node} "
                f"has not reported GPU {gpu} re-cut (gpush agent --allow-mig-changes re-cuts it first)"
            )
        made = {f"{m.profile}@{m.placement_start}": (m.gi_id, m.ci_id) for m in reported.mig_instances}
        caps = self.ctx.settings.mig_caps_dir.replace("{node}", node)
        gres = GresConf(_read(gres_path), str(gres_path))
        before = gres.devices(node)
        # The GPU's own device, as its lines name it (MultipleFiles=), else beside the capabilities.
        gpu_device = next(
            (f for d in before if d.gpu == gpu for f in d.files if re.search(rf"/nvidia{gpu}\Z", f)),
            f"{posixpath.dirname(caps.rstrip('/'))}/nvidia{gpu}",
        )
        devices = mig_devices(gpu, caps, instances, made, style=gres.style(node), gpu_device=gpu_device)
        new_gres = gres.with_gpu(node, gpu, devices)
        wanted = gres_counts(GresConf(new_gres, str(gres_path)).devices(node))
        old_slurm = _read(slurm_path)
        new_slurm = with_node_gres(old_slurm, node, wanted, str(slurm_path))
        try:
            if new_gres != gres.text:
                replace_file(gres_path, new_gres)
            if new_slurm != old_slurm:
                replace_file(slurm_path, new_slurm)
        except OSError as exc:
            raise Misconfigured(
                f"cannot write {exc.filename or gres_path}: {exc.strerror or exc}; the broker rewrites gres.conf "
                "and slurm.conf for MIG changes (run it where it may, or set mig_gres_conf to a file it may write)"
            ) from None
        if self._offered_counts(node) != wanted:
            self._reload(node)

    def mig_published(self, node: str, gpu: int) -> tuple[str, ...] | None:
        """The instances GPU ``gpu`` of ``node`` offers: those gpush's lines in gres.conf
        name, once slurmctld offers the counts the files add up to; None before (the
        daemons have not read them) or where the GPU's lines are not gpush's (no comment
        says where its instances lie)."""
        gres_path, _ = self._mig_files()
        devices = GresConf(_read(gres_path), str(gres_path)).devices(node)
        mine = [d for d in devices if d.gpu == gpu and d.gi is not None]
        if any(d.slot is None for d in mine) or self._offered_counts(node) != gres_counts(devices):
            return None
        found = self.ctx.node(node)
        if any(s in ("DOWN", "NOT_RESPONDING", "UNKNOWN", "FUTURE") for s in found.states):
            return None  # slurmd has not registered the files it read yet
        return tuple(d.slot for d in mine if d.slot)

    def _mig_files(self) -> tuple[Path, Path]:
        settings = self.ctx.settings
        gres = settings.mig_gres_conf
        slurm = settings.mig_slurm_conf or settings.slurm_conf
        if not gres:
            raise Rejected(f"Slurm cluster {self.ctx.name} takes no MIG layout from gpush: set its mig_gres_conf")
        if not slurm:
            raise Rejected(
                f"Slurm cluster {self.ctx.name}: set mig_slurm_conf (or slurm_conf), the slurm.conf to rewrite"
            )
        return Path(gres), Path(slurm)

    def _offered_counts(self, node: str) -> Counter[str | None]:
        return Counter({g.type: g.count for g in self.ctx.node(node, fresh=True).gres if g.name == "gpu"})

    def _reload(self, node: str) -> None:
        settings = self.ctx.settings
        argv = shlex.split(settings.mig_reload.replace("{node}", node))  # checked by the settings
        if argv[0] == "scontrol":  # Slurm's own command: where the cluster's commands run
            prefix = shlex.split(settings.command_prefix or "")
            command = posixpath.join(settings.bin_dir, "scontrol") if settings.bin_dir else "scontrol"
            argv = [*prefix, command, *argv[1:]]
        env = dict(os.environ)
        if settings.slurm_conf:
            env["SLURM_CONF"] = settings.slurm_conf
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=settings.timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unreachable(f"mig_reload {settings.mig_reload!r} for {node}: {exc}") from None
        self.ctx.forget_nodes()
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise Unreachable(
                f"mig_reload {settings.mig_reload!r} for {node} exited {done.returncode}: "
                f"{said[-1] if said else 'nothing said'}"
            )


def _read(path: Path) -> str:
    """A Slurm config file gpush rewrites; :class:`Misconfigured` when it cannot be read."""
    try:
        return path.read_text()
    except OSError as exc:
        raise Misconfigured(f"cannot read {path}: {exc.strerror or exc}; gpush rewrites it for MIG changes") from None
