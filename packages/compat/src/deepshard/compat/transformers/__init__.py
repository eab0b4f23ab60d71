"""transformers' ``Trainer`` on deepshard: change ``from transformers import Trainer, TrainingArguments``
to ``from deepshard.compat.transformers import Trainer, TrainingArguments``; ``deepspeed=`` (a
ds_config path or dict) then runs on deepshard's engine instead of DeepSpeed.  See the README
section "Coming from the HF Trainer".
"""

from __future__ import annotations

from .arguments import TrainingArguments
from .trainer import Trainer

__all__ = ["Trainer", "TrainingArguments"]
