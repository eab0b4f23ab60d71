"""deepshard.core."""
