"""``deepspeed.runtime.dataloader.RepeatingLoader``."""

from ..utils import RepeatingLoader

__all__ = ["RepeatingLoader"]
