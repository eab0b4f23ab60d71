"""``deepspeed.ops``: the optimizer classes scripts build themselves (``ops.adam``)."""

from . import adam

__all__ = ["adam"]
