"""deepshard finetune, the Hydra entry point:  python apps/finetune/main.py +zero=stage3

Bad config values end the run before any work, with one line naming the key (exit 2).  A run that
fails later ends with one line too: a worker's error with its rank (exit 2), a rank that died or
hung, or a diverged run (exit 1).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from deepshard.finetune.config import register
from deepshard.finetune.ds_config import merge_argv

register()


@hydra.main(version_base=None, config_path=str(Path(__file__).resolve().parents[2] / "conf"), config_name="config")
def main(cfg: DictConfig) -> None:
    from deepshard.finetune.app import RunFailed, run

    try:
        run(cfg, HydraConfig.get().runtime.output_dir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except RunFailed as err:  # a worker's error, a dead or hung rank, divergence: one line, the last
        sys.stdout.flush()
        print(f"\nerror: {err}", file=sys.stderr)  # a worker's progress bar may have left the line open
        sys.exit(err.code)


def exit_without_teardown(code: int | str | None) -> None:
    """Exit as the interpreter would, without its module teardown: with torch, dynamo and
    transformers loaded that takes 1-2 s and does nothing a finished run needs.  What matters is
    kept: other threads joined, exit handlers run (logging, swap-file removal), streams flushed."""
    if isinstance(code, str):  # sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    try:
        try:  # +deepspeed=ds_config.json: the file's settings become overrides ahead of the command line's
            sys.argv = merge_argv(sys.argv)[0]
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        main()
    except SystemExit as done:
        exit_without_teardown(done.code)
    exit_without_teardown(0)
