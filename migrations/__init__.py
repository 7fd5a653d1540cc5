"""Alembic environment and the one linear history of gpush's schema."""
