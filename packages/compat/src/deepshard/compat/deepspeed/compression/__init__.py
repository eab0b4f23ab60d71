"""``deepspeed.compression``: only ``helper.recursive_getattr`` (the one name DeepSpeed's examples use)."""

from . import helper

__all__ = ["helper"]
