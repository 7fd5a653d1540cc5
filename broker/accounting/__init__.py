"""Accounting: GPU-hours in physical GPU-equivalents from the job events (usage.py)."""
