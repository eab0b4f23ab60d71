"""The command-line tools: export (HF model or PEFT adapter), the memory estimate, and the converters
from and to DeepSpeed checkpoints."""
