"""The scheduling cycle: orchestration, claim, status sync, submission, leader election,
clusters, scaling.
"""
