"""The Kubernetes adapter: gpush jobs on time-sliced GPUs, MIG slices and whole GPUs.

:mod:`adapters.k8s.client` is the only code that imports the official ``kubernetes``
client; :mod:`adapters.k8s.render` turns a job into a Job or Deployment;
:mod:`adapters.k8s.states` says what the objects' states mean to gpush;
:mod:`adapters.k8s.inventory` reads the node pool's GPUs; :mod:`adapters.k8s.timeslice`
renders and applies the GPU Operator's time-slicing configuration; :mod:`adapters.k8s.tenancy`
says which namespace each tenant's jobs go to and renders its ResourceQuota;
:mod:`adapters.k8s.adapter` implements the broker's adapter protocol on top, composing one
class per concern (its docstring names them).
"""

from adapters.k8s.adapter import KubernetesAdapter, KubernetesSettings
from adapters.k8s.timeslice import TimeslicePlan, apply_timeslice, read_timeslice, render_timeslice

__all__ = [
    "KubernetesAdapter",
    "KubernetesSettings",
    "TimeslicePlan",
    "apply_timeslice",
    "read_timeslice",
    "render_timeslice",
]
