"""deepshard.offload."""
