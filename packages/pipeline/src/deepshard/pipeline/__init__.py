"""deepshard.pipeline."""
