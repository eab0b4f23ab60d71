"""The training recipe: run assembly, the training loop and its parts (steppers, checkpoints, divergence,
evaluation, sampling, logging, profiling, the test-fault seam)."""
