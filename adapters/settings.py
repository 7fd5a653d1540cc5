"""A cluster's adapter settings, read from `gpush cluster add ... --config KEY=VALUE`.

Every adapter declares its settings as a pydantic model that forbids unknown keys;
:func:`load_settings` validates a config against it and turns pydantic's complaints
into one message an admin can act on: the setting, what is wrong, and for a
misspelt key the setting they probably meant and the list of all of them.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from broker.core.errors import InvalidRequest

Settings = TypeVar("Settings", bound=BaseModel)


def settings_problems(exc: ValidationError, model: type[BaseModel]) -> str:
    """Pydantic's complaints about a config for ``model``, in an admin's terms."""
    known = sorted(model.model_fields)
    problems = []
    for error in exc.errors():
        key = ".".join(map(str, error["loc"])) or "config"
        if error["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, known, n=1) or [k for k in known if key in k][:1]
            hint = f"did you mean {close[0]}? " if close else ""
            problems.append(f"unknown setting {key!r}: {hint}settings are {', '.join(known)}")
        else:
            # "Value error, " is how pydantic wraps a validator's own words: they say it already.
            message = str(error["msg"]).removeprefix("Value error, ")
            problems.append(f"{key}: {message}" if error["loc"] else message)
    return "; ".join(problems)


def key_value_pairs(value: Any, what: str, example: str, form: str = "KEY=VALUE") -> Any:
    """A mapping setting as the command line gives it, ``"k=v,k2=v2"``, as a dict (a dict
    passes through); ``form`` and ``example`` make the error say what is expected."""
    if isinstance(value, str):
        pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"{what} is {form}[,{form}...], e.g. {example}")
        return {k.strip(): v.strip() for k, v in pairs}
    return value


def load_settings(model: type[Settings], config: Mapping[str, Any], *, cluster: str) -> Settings:
    """``config`` as ``model``, or :class:`InvalidRequest` naming the cluster and each problem."""
    try:
        return model.model_validate(dict(config))
    except ValidationError as exc:
        raise InvalidRequest(f"{cluster}: {settings_problems(exc, model)}") from None
