// Streaming-read probe for the roofline: every byte of a large buffer read once with
// 16-byte non-allocating loads, 8 independent loads in flight per thread; a per-thread
// XOR lands in `sink` so the loads cannot be dropped.
#include "roofline.h"

namespace pkv {
namespace {

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__global__ void __launch_bounds__(512) read_kernel(const uint4* __restrict__ src, int64_t n, uint32_t* sink) {
  constexpr int kUnroll = 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = ld_stream(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = ld_stream(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  sink[static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}

}  // namespace

cudaError_t launch_read_probe(const void* src, int64_t bytes, uint32_t* sink, int blocks, cudaStream_t stream) {
  if (bytes % 16 != 0 || blocks < 1) return cudaErrorInvalidValue;
  read_kernel<<<blocks, kReadProbeThreads, 0, stream>>>(static_cast<const uint4*>(src), bytes / 16, sink);
  return cudaGetLastError();
}

}  // namespace pkv
