"""What a job sees: its environment (one owner, both renderers call it), and the helpers
that run inside it.
"""
