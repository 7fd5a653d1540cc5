"""The routing policies gpush ships (YAML), installed with the package so `gpush` finds
them wherever it runs. Admins copy one, edit it, and `gpush policy apply` it."""

from importlib.resources import files


def shipped(name: str = "default.yaml") -> str:
    """The path of a shipped policy file."""
    return str(files(__name__) / name)
