"""Placement: the one decision (broker.placement.decision), free capacity, fragmentation,
fair share, tenants.
"""
