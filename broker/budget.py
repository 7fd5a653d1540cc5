"""The name job code imports: ``from broker.budget import apply_gpu_memory_budget``.

The helpers live in :mod:`broker.jobenv.budget` (they run inside a user's job, not in
the broker); this module keeps the name users already wrote into their code working.
"""

from broker.jobenv.budget import apply_gpu_memory_budget, budget_fraction

__all__ = ["apply_gpu_memory_budget", "budget_fraction"]
