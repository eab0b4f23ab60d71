"""The local workers' server, started by ``main.py`` before it imports torch and composes the config.

A run's start is two chains on two cores: this process (torch, Hydra, the config, the memory and data
checks) and the forkserver the workers fork from (torch, dynamo, the recipe, the tokenizer).  Started
after the checks, the server finished ~2 s after them; started first, its imports run beside them.
This module imports neither torch nor the config, so the server really starts first.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from deepshard.finetune.data.tokenizer import TOKENIZER_MODULE
from deepshard.launch.worker_server import start_worker_server, stop_worker_server

WORKER_MODULES = ("deepshard.finetune.recipe.assemble", TOKENIZER_MODULE)  # train_worker's, the tokenizer's
# Hydra's flags that print or inspect instead of running a job
NOT_A_RUN = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--resolve", "--package", "-p",
             "--shell-completion", "-sc", "--multirun", "-m", "--version"}


def under_torchrun() -> bool:
    """torchrun (any node count) already started one process per rank and set the environment."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def start_early(argv: Sequence[str]) -> None:
    """Start the server unless this process will be the worker itself or runs no job; a run that
    turns out to need no local workers stops it (:func:`not_needed`)."""
    if under_torchrun() or any(arg.split("=", 1)[0] in NOT_A_RUN for arg in argv[1:]):
        return
    start_worker_server(WORKER_MODULES)


def not_needed() -> None:
    """The run trains in this process (one rank): the server's imports would only compete with it."""
    stop_worker_server()
