"""The Kubernetes adapter (official kubernetes client). Not in this release yet."""
