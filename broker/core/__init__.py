"""The broker's vocabulary: job spec and records, states, errors, the GPU catalog,
configuration, the database, the clock, the adapter protocol, metrics.
"""
