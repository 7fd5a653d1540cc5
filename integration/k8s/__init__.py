"""Kubernetes for the integration suite: a test API server that speaks the real REST API, and its node simulator."""
