"""deepshard finetune, the Hydra entry point:  python apps/finetune/main.py +zero=stage3

Bad config values end the run before any work, with one line naming the key (exit 2).  A run that
fails later ends with one line too: a worker's error with its rank (exit 2), a rank that died or
hung, or a diverged run (exit 1).
"""

from __future__ import annotations

import sys
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


if __name__ == "__main__":
    try:  # +deepspeed=ds_config.json: the file's settings become overrides ahead of the command line's
        sys.argv = merge_argv(sys.argv)[0]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
