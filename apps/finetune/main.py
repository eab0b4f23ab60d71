"""deepshard finetune, the Hydra entry point:  python apps/finetune/main.py +zero=stage3

Bad config values end the run before any work, with one line naming the key.
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
    from deepshard.finetune.app import run

    try:
        run(cfg, HydraConfig.get().runtime.output_dir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    try:  # +deepspeed=ds_config.json: the file's settings become overrides ahead of the command line's
        sys.argv = merge_argv(sys.argv, conf_dir=Path(__file__).resolve().parents[2] / "conf")[0]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
