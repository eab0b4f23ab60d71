"""Shared test settings: one thread per process keeps multi-rank tests honest on 2 cores."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
