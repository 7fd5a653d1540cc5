"""gpush broker: tier 1 of the hybrid GPU meta-scheduler.

The broker owns the global queue of GPU jobs, their states, the REST API, the
client SDK and the ``gpush`` command line. Adapters for Slurm and Kubernetes live
in ``adapters`` and import only the broker's public types.
"""

__version__ = "0.1.0"
