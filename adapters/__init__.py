"""Cluster adapters: one folder per backend, each implementing broker.core.adapter.ClusterAdapter."""
