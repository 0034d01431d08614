// The online-softmax state (m, l, acc) of attention over a token range, in FP32 and the
// log2 domain, and its one merge rule: states s merge into
//   m = max_s m_s,  l = sum_s w_s l_s,  acc = sum_s w_s acc_s,  w_s = 2^(m_s - m),
// with w_s = 0 for an empty state (m_s = -inf). Every merge in the kernels (warps of a
// CTA, splits of a segment, the ranks of a cluster) goes through rescale().
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <utility>

#include "pkv_decode.h"
#include "ptx.cuh"

namespace pkv {

__device__ __forceinline__ float rescale(float m_s, float m) { return m_s == -INFINITY ? 0.f : exp2f(m_s - m); }
// Natural-log log-sum-exp of the logits of a state (m, l) kept in the log2 domain.
__device__ __forceinline__ float lse_of(float m, float l) { return (m + log2f(l)) * 0.693147180559945309f; }
// A head's sink (natural-log logit) in the log2 domain; -inf when there is none.
__device__ __forceinline__ float sink_log2(const float* sinks, int64_t head) {
  return sinks != nullptr ? sinks[head] * 1.44269504088896341f : -INFINITY;
}
// The final normalization of a head's whole state (m, l): the sink's term 2^(s2 - m) joins the
// denominator, once (never a partial state's). Returns the factor of acc (w / l' for the output
// acc * it) and leaves in m, l the state whose LSE (lse_of) includes the sink.
__device__ __forceinline__ float finish_state(float& m, float& l, float s2) {
  if (s2 == -INFINITY) return 1.f / l;
  const float mx = fmaxf(m, s2), w = rescale(m, mx);
  l = w * l + exp2f(s2 - mx);
  m = mx;
  return w / l;
}


// Exact merge of the n partial states slot_of(0..n-1) of one segment into its G output
// heads (normalized). kCoherent reads through L2 (__ldcg): states written by other CTAs
// of the same launch. The merge is latency-bound (a few KB to a few hundred KB), so it
// is built to take few L2 round trips: (1) every m and every l in one round (staged in
// s_w: 2 n G floats when s_w_floats allows, else l is read in step 2); (2) one warp per
// head reduces max and denominator from shared memory; (3) threads own float4 columns of
// acc and stream the states with the weights, kInFlight loads in flight (a serial per-state
// loop would cost one L2 round trip per state). s_red: blockDim.x float4.
// lse: null or the G heads' merged LSE (lse_of), FP32.
template <typename T, int D, bool kCoherent, class SlotOf>
__device__ void merge_states(const float* partial, int num_slots, int G, int n, SlotOf slot_of, T* out_heads,
                             float* s_w, int s_w_floats, float4* s_red, float* lse = nullptr) {
  constexpr int kInFlight = 16;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const float* m = partial;
  const float* l = partial + static_cast<int64_t>(num_slots) * G;
  const float4* acc = reinterpret_cast<const float4*>(partial + acc_offset(num_slots, G));
  auto ld = [](const float* q) { return kCoherent ? __ldcg(q) : __ldg(q); };
  auto ld4 = [](const float4* q) { return kCoherent ? __ldcg(q) : __ldg(q); };
  const int cols = G * D / 4;                      // float4 columns of acc per slot
  const int lanes = cols >= nt ? 1 : nt / cols;    // threads splitting one column's slots
  const int span = nt / lanes;                     // columns per pass

  __shared__ float s_max[16], s_inv[16];
  const int ng = n * G;
  float* s_l = 2 * ng <= s_w_floats ? s_w + ng : nullptr;
  for (int i = tid; i < ng; i += nt) {
    const int64_t at = static_cast<int64_t>(slot_of(i / G)) * G + i % G;
    s_w[i] = ld(m + at);
    if (s_l) s_l[i] = ld(l + at);
  }
  __syncthreads();
  for (int g = warp; g < G; g += nt / 32) {
    float mx = -INFINITY;
    for (int s = lane; s < n; s += 32) mx = fmaxf(mx, s_w[s * G + g]);
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float den = 0.f;
    for (int s = lane; s < n; s += 32)
      den += rescale(s_w[s * G + g], mx) * (s_l ? s_l[s * G + g] : ld(l + static_cast<int64_t>(slot_of(s)) * G + g));
#pragma unroll
    for (int o = 16; o; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
    if (lane == 0) s_max[g] = mx, s_inv[g] = 1.f / den;
    if (lane == 0 && lse != nullptr) lse[g] = lse_of(mx, den);
  }
  __syncthreads();
  for (int i = tid; i < ng; i += nt) s_w[i] = rescale(s_w[i], s_max[i % G]) * s_inv[i % G];
  __syncthreads();

  for (int c0 = 0; c0 < cols; c0 += span) {
    const int c = c0 + tid % span, r = tid / span;
    const int h = c / (D / 4);
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < cols && r < lanes) {
      for (int s0 = r; s0 < n; s0 += kInFlight * lanes) {
        float4 v[kInFlight];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u)  // clamped (weight 0 past n): all loads issue back to back
          v[u] = ld4(acc + static_cast<int64_t>(slot_of(min(s0 + u * lanes, n - 1))) * cols + c);
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          const int s = s0 + u * lanes;
          const float w = s < n ? s_w[s * G + h] : 0.f;
          sum.x += w * v[u].x; sum.y += w * v[u].y; sum.z += w * v[u].z; sum.w += w * v[u].w;
        }
      }
    }
    if (lanes > 1) {
      s_red[tid] = sum;
      __syncthreads();
      if (r == 0 && c < cols)
        for (int k = 1; k < lanes; ++k) {
          const float4 o = s_red[k * span + tid];
          sum.x += o.x; sum.y += o.y; sum.z += o.z; sum.w += o.w;
        }
      __syncthreads();
    }
    if (r == 0 && c < cols) {
      Mma<T>::store2(out_heads + 4 * c, sum.x, sum.y);
      Mma<T>::store2(out_heads + 4 * c + 2, sum.z, sum.w);
    }
  }
}

// Launch `kernel` as a programmatic dependent of the kernel queued before it on `stream` (PDL):
// it may start while that kernel runs (once its CTAs have issued griddep_launch_dependents, or
// exited) and waits for it at griddep_wait. Inside stream capture this is a programmatic edge.
template <typename... Params, typename... Args>
inline cudaError_t launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                       cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace pkv
