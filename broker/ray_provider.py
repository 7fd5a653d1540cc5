"""The name Ray cluster YAMLs give gpush's node provider:
``provider: {type: external, module: broker.ray_provider.GpushNodeProvider}``.

The provider lives in :mod:`broker.ray.provider`; this module keeps the name users
already wrote into their cluster configs working.
"""

from broker.ray.provider import GpushNodeProvider

__all__ = ["GpushNodeProvider"]
