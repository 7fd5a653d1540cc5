"""Routing policies: the rules, their evaluation and validation, and their stored versions."""
