"""``deepspeed.moe``: refused (see ``moe.layer``)."""

from . import layer

__all__ = ["layer"]
