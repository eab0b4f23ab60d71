"""torchelastic's rendezvous names each of its steps by the calling method, through ``inspect.stack()``:
twice per step, and each call reads the source lines of every frame on the stack.  A launch's agent
pays ~1 s of CPU for these names alone (measured here: 50 of 230 samples of a small app run's
launching process), before any worker starts, and again at every restart.

:func:`name_steps_cheaply` puts a frame lookup in its place: the same name (the function ``depth``
frames up, ``"no_method_name"`` above the stack's top), none of the source reading.  Only the name of
torch 2.13's ``dynamic_rendezvous.get_method_name`` is replaced; if torch drops or renames it, nothing is
replaced (tests/launch/test_rendezvous_names.py then fails, saying so).
"""

from __future__ import annotations

import sys

_NO_NAME = "no_method_name"  # torch's answer when the stack is shallower than ``depth``
replaced: dict[str, object] = {}  # torch's own function, once replaced (for the tests that compare)


def method_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames above this one (0: this function itself), as
    ``inspect.stack()[depth].function`` gives it."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return _NO_NAME


def name_steps_cheaply() -> bool:
    """Make torchelastic's rendezvous name its steps with :func:`method_name`; True where it could."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    torchs = getattr(dynamic_rendezvous, "get_method_name", None)
    if not callable(torchs):
        return False
    if torchs is not method_name:
        replaced["get_method_name"] = torchs
        dynamic_rendezvous.get_method_name = method_name
    return True
