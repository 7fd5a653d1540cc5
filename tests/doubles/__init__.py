"""Test doubles that behave as the real thing does, for tests/ and integration/ alone: no
product module imports them (tests/client/test_imports.py)."""
