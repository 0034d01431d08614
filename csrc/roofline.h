// Streaming-read probe used by `pkv bench kernels` to measure the read roofline.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace pkv {

constexpr int kReadProbeThreads = 512;

// Reads `bytes` (a multiple of 16) from `src` once; `sink` holds blocks * kReadProbeThreads words.
cudaError_t launch_read_probe(const void* src, int64_t bytes, uint32_t* sink, int blocks, cudaStream_t stream);

}  // namespace pkv
