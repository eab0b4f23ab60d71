"""deepshard.finetune: the Hydra fine-tuning app."""
