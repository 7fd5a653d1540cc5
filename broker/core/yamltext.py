"""YAML that people write (job files, fleet files): parsed, or refused at the line and column.

Routing policies have their own loader (broker.routing.policy), which also maps schema
errors back to positions in the file.
"""

from __future__ import annotations

from typing import Any

import yaml

from broker.core.errors import InvalidRequest


def load_yaml(text: str, *, source: str, all_documents: bool = False) -> Any:
    """The document (or, with ``all_documents``, the list of non-empty documents) of ``text``."""
    try:
        if all_documents:
            return [d for d in yaml.safe_load_all(text) if d is not None]
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source
        raise InvalidRequest(f"{where}: not valid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise InvalidRequest(f"{source}: not valid YAML: {exc}") from None
