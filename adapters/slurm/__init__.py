"""The Slurm adapter (slurmrestd and command-line backends). Not in this release yet."""
