"""deepshard.kernels."""
