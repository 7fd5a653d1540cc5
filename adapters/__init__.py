"""Cluster adapters: one folder per backend, each implementing broker.adapter.ClusterAdapter."""
