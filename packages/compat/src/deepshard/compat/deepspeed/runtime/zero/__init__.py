"""``deepspeed.runtime.zero``: the same names as ``deepspeed.zero``."""

from ...zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter
from . import partition_parameters

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters", "register_external_parameter"]
