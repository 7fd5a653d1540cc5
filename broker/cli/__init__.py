"""The ``gpush`` command line: click commands (one module per concern, registered on the
root group of broker.cli.main) over logic free of click (broker.cli.commands), rendered
for a terminal by broker.cli.console.

``broker.cli:main`` is the console script's entry point (pyproject.toml), so ``main``
is importable from here.
"""

from broker.cli.main import main

__all__ = ["main"]
