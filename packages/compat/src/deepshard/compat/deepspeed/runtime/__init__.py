"""``deepspeed.runtime``: the import paths scripts use (``runtime.utils``, ``runtime.zero``)."""

from . import utils, zero

__all__ = ["utils", "zero"]
