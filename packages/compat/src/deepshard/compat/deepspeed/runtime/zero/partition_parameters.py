"""``deepspeed.runtime.zero.partition_parameters``: ``ZeroParamStatus`` and the ZeRO-3 context managers."""

from ...zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
