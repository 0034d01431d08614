// The graph decode's host side: launchers by dtype, head_dim and rows per CTA, the launch's
// argument checks, and the trace read-back. The kernel is graph_decode_kernel.cuh; graph_decode.h
// says what a launch computes.
#include "graph_decode.h"

#include "graph_decode_kernel.cuh"

namespace pkv {
namespace {

template <typename T, int D, int kRows, bool kFp8>
cudaError_t launch_typed(const GraphDecodeParams& p, bool pdl, cudaStream_t stream) {
  auto kernel = graph_decode_kernel<T, D, kRows, kFp8>;
  constexpr int smem = AttendCfg<D, kFp8>::kSmemTotal;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  if (pdl) return launch_programmatic(kernel, dim3(p.num_ctas), dim3(kThreads), smem, stream, p);
  kernel<<<p.num_ctas, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D, bool kFp8>
cudaError_t launch_group(const GraphDecodeParams& p, bool pdl, cudaStream_t stream) {
  if (p.group * p.q_block <= 8) return launch_typed<T, D, 1, kFp8>(p, pdl, stream);  // a pass's query rows
  if constexpr (D <= 128) return launch_typed<T, D, 2, kFp8>(p, pdl, stream);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_dim(const GraphDecodeParams& p, bool kv_fp8, int head_dim, bool pdl, cudaStream_t stream) {
  if (kv_fp8) {
    static_assert(kFp8MaxHeadDim == 128, "FP8 builds head_dim 64 and 128");
    switch (head_dim) {
      case 64: return launch_group<T, 64, true>(p, pdl, stream);
      case 128: return launch_group<T, 128, true>(p, pdl, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (head_dim) {
    case 64: return launch_group<T, 64, false>(p, pdl, stream);
    case 128: return launch_group<T, 128, false>(p, pdl, stream);
    case 256: return launch_group<T, 256, false>(p, pdl, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int graph_decode_ctas_per_sm(int head_dim) {
  return head_dim == 64 ? AttendCfg<64>::kCtasPerSm : head_dim == 128 ? AttendCfg<128>::kCtasPerSm
                                                                      : AttendCfg<256>::kCtasPerSm;
}

cudaError_t launch_graph_decode(const GraphDecodeParams& p, DType dtype, bool kv_fp8, int head_dim, bool pdl,
                                cudaStream_t stream) {
  if (p.group < 1 || p.group > kMaxGroup || p.num_rows < 1 || p.num_rows > kGraphMaxRows || p.num_ctas < 1 ||
      p.num_ctas >= kLate - kMergeSlices || p.min_tiles < 1 || p.piece_cost < 0 || p.piece_cost > kMaxPieceCost ||
      p.counter_stride < 1 || p.counter_stride > kMaxCounterStride || p.spin_ns < 0 || p.spin_ns > kMaxSpinNs ||
      (p.page_scales != nullptr && (!kv_fp8 || (1 << p.page_shift) < kChunk)) || p.window_left < -1 ||
      p.q_len < 1 || p.q_len > kMaxQLen || p.q_block != graph_query_block(p.group, head_dim, p.q_len) ||
      p.q_blocks != (p.q_len + p.q_block - 1) / p.q_block || p.counter_stride * p.q_blocks > kMaxCounterStride ||
      p.short_tiles < 0)
    return cudaErrorInvalidValue;
  return dtype == DType::kFloat16 ? launch_dim<__half>(p, kv_fp8, head_dim, pdl, stream)
                                  : launch_dim<__nv_bfloat16>(p, kv_fp8, head_dim, pdl, stream);
}

cudaError_t read_graph_trace(unsigned long long* dst) {
#if PKV_TRACE
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpyFromSymbol(dst, g_trace, sizeof(g_trace));
  void* addr = nullptr;
  if (err == cudaSuccess) err = cudaGetSymbolAddress(&addr, g_trace);
  if (err == cudaSuccess) err = cudaMemset(addr, 0, sizeof(g_trace));
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  return err;
#else
  (void)dst;
  return cudaErrorNotSupported;
#endif
}

}  // namespace pkv
