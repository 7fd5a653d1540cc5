"""Simulation: the simulated fleet, the replay engines (which call the one decision),
traces, reports and plots.
"""
