"""``import deepshard.compat.provide_deepspeed``: from here on, ``import deepspeed`` is deepshard's engine.

The one documented line for a plain ``python``/``torchrun`` start (the ``deepshard`` launcher and
``DEEPSHARD_DEEPSPEED=1`` do the same through the ``.pth`` our package installs); the machinery, and
importing it without this effect, is :mod:`deepshard.compat.deepspeed_provider`.
"""

from deepshard.compat.deepspeed_provider import activate

activate()
