"""deepshard finetune, the Hydra entry point:  python apps/finetune/main.py +zero=stage3

Bad config values end the run before any work, with one line naming the key (exit 2); so do Hydra's
own refusals (an override typo, a group option that does not exist, a run directory that cannot be
written): Hydra raises them here instead of printing them (``HYDRA_FULL_ERROR=1`` until our task
starts; set it yourself for Hydra's full trace).  A run that
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
from deepshard.finetune.config.ds_config import merge_argv

register()
USER_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR")  # the user's setting, restored when the task starts


@hydra.main(version_base=None, config_path=str(Path(__file__).resolve().parents[2] / "conf"), config_name="config")
def main(cfg: DictConfig) -> None:
    from deepshard.finetune.app import RunFailed, run

    _restore_full_error()  # from here on Hydra reports our task's errors as it always did

    try:
        run(cfg, HydraConfig.get().runtime.output_dir, HydraConfig.get())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except RunFailed as err:  # a worker's error, a dead or hung rank, divergence: one line, the last
        sys.stdout.flush()
        print(f"\nerror: {err}", file=sys.stderr)  # a worker's progress bar may have left the line open
        sys.exit(err.code)


def _restore_full_error() -> None:
    if USER_FULL_ERROR is None:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    else:
        os.environ["HYDRA_FULL_ERROR"] = USER_FULL_ERROR


def run_hydra(argv: list[str], translation) -> None:
    """``main()``, with what Hydra refuses before our task runs as one ``error:`` line (exit 2)."""
    from deepshard.finetune.config.hydra_errors import error_line

    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing its several lines
    try:
        main()
    except Exception as err:
        line = None if USER_FULL_ERROR == "1" else error_line(err, argv, translation)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    finally:
        _restore_full_error()


def exit_without_teardown(code: int | str | None) -> None:
    """Exit as the interpreter would, without its module teardown: with torch, dynamo and
    transformers loaded that takes 1-2 s and does nothing a finished run needs.  What matters is
    kept: other threads joined, exit handlers run (logging, swap-file removal), streams flushed."""
    if isinstance(code, str):  # sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    # the interpreter's own first step: thread pools' exit hooks wake their idle workers (an offload
    # store's aio pool), then every non-daemon thread is joined; joining first waits on them forever
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    try:
        # deepshard/deepspeed launchers pass --local_rank=N (unless --no_local_rank); LOCAL_RANK says the same
        sys.argv = [a for a in sys.argv if not a.startswith("--local_rank=")]
        try:  # +deepspeed=ds_config.json: the file's settings become overrides ahead of the command line's
            sys.argv, translation = merge_argv(sys.argv)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        run_hydra(sys.argv, translation)
    except SystemExit as done:
        exit_without_teardown(done.code)
    exit_without_teardown(0)
