"""The CUDA kernels' JIT loader (csrc/) and the FP32 reference that every engine is checked against."""
