"""``deepspeed.launcher``: what ``accelerate launch`` reads from DeepSpeed's launcher (``launcher.runner``)."""
