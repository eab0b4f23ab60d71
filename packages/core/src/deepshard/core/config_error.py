"""A bad value of a library config, named by the config's own field.

Core names its fields as core knows them (``stage=4: valid stages are 0, 1, 2, 3``); whoever built the
config from a user's file puts the user's key in front (:meth:`ConfigError.under`: the app's
``zero.stage``, a ds_config's ``zero_optimization.stage``), so no message is ever rewritten by pattern.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def shown(value: Any) -> str:
    """A value as the messages show it: strings quoted, tuples as lists, numbers as they are."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, tuple):
        return str(list(value))
    return str(value)


class ConfigError(ValueError):
    """``field=value: reason``; ``field`` is the config's own name for it (dotted when nested)."""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field}={shown(value)}: {reason}")

    def under(self, prefix: str | Callable[[str], str]) -> ConfigError:
        """The same error under the caller's key: ``prefix.field``, or ``prefix(field)`` for a mapping."""
        key = prefix(self.field) if callable(prefix) else f"{prefix}.{self.field}"
        return ConfigError(key, self.value, self.reason)


@contextmanager
def named(prefix: str | Callable[[str], str]) -> Iterator[None]:
    """Re-raise a ConfigError from the block under the caller's key (see :meth:`ConfigError.under`)."""
    try:
        yield
    except ConfigError as err:
        raise err.under(prefix) from None
