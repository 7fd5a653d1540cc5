"""The Slurm adapter: gpush jobs on MIG slices (typed GRES), MPS shares and whole GPUs.

:mod:`adapters.slurm.client` is the only code that talks to Slurm (slurmrestd or the
command line); :mod:`adapters.slurm.render` turns a job into a batch job;
:mod:`adapters.slurm.adapter` implements the broker's adapter protocol on top (one
module per concern behind it: its docstring names them);
:mod:`adapters.slurm.output` reads a job's output files for ``gpush logs``.
Supported: Slurm 22.05 (OpenAPI v0.0.38) and 24.11 (v0.0.40 to v0.0.42).
"""

from adapters.slurm.adapter import SlurmAdapter, SlurmSettings

__all__ = ["SlurmAdapter", "SlurmSettings"]
