"""The ``gpush`` command line: one module per resource or concern (registered on the
root group of broker.cli.main), in which each click command only parses its arguments and
calls the plain function beside it that does the work: free of click, it takes the client
(or a database URL), the parsed values and an :class:`~broker.cli.console.Output`, and
returns the exit code, so tests and other front ends call it directly (a few commands
of one client call, such as ``scale``, do it in place). Rendering for a terminal is
broker.cli.console's; what several modules read, broker.cli.settings (the global options,
``--json``) and broker.cli.input_files (a file named on the command line, or stdin).

``broker.cli:main`` is the console script's entry point (pyproject.toml), so ``main``
is importable from here.
"""

from broker.cli.main import main

__all__ = ["main"]
