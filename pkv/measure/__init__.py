"""Measuring: the one timer module, the decode-step loop, calibration, the pipeline stages, the model-level step
and the Nsight capture."""
