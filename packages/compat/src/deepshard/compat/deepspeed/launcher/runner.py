"""``deepspeed.launcher.runner``: the name of DeepSpeed's per-run environment file.

accelerate's ``deepspeed_launcher`` imports ``DEEPSPEED_ENVIRONMENT_NAME`` before it starts the workers
(it writes the file only for multi-node pdsh runs, which deepshard starts with ``deepshard --hostfile``;
one node goes through torchrun).  The ``deepspeed`` command itself is ``deepshard``.
"""

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"  # DeepSpeed 0.19.8's value
