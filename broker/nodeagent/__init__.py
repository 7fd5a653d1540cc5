"""The node agent, which runs on GPU nodes: what NVML says, reported to the broker.

Nothing here imports the broker's server side."""
