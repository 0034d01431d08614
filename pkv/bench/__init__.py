"""Benchmarks outside the serving loop: kernel device time, the host-planned split benchmark, the host path
per step and FP8 accuracy."""
