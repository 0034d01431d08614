"""Benchmarks outside the serving loop: kernel device time, the v3 split benchmark, the host path per step and FP8 accuracy."""
