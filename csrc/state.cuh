// The online-softmax state (m, l, acc) of attention over a token range, in FP32 and the
// log2 domain, and its one merge rule: states s merge into
//   m = max_s m_s,  l = sum_s w_s l_s,  acc = sum_s w_s acc_s,  w_s = 2^(m_s - m),
// with w_s = 0 for an empty state (m_s = -inf). Every merge in the kernels (warps of a
// CTA, splits of a segment, the ranks of a cluster) goes through rescale().
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "pkv_decode.h"
#include "ptx.cuh"

namespace pkv {

__device__ __forceinline__ float rescale(float m_s, float m) { return m_s == -INFINITY ? 0.f : exp2f(m_s - m); }


// Exact merge of the n partial states slot_of(0..n-1) of one segment into its G output
// heads (normalized). kCoherent reads through L2 (__ldcg): states written by other CTAs
// of the same launch. Threads own float4 columns of acc (lanes > 1 threads share a
// column's states) and fold the states into a running (m, l, acc) with rescale(); each
// batch of kInFlight states issues its acc, m and l loads together, so the merge costs
// ceil(n / kInFlight) L2 round trips. (Weights first, then acc, cost two more; a serial
// loop over the states one per state: ~10 us at 24 splits, ncu of the v3 merge.)
// s_red holds blockDim.x float4 and s_ml blockDim.x float2.
template <typename T, int D, bool kCoherent, class SlotOf>
__device__ void merge_states(const float* partial, int num_slots, int G, int n, SlotOf slot_of, T* out_heads,
                             float4* s_red, float2* s_ml) {
  constexpr int kInFlight = 16;
  const int tid = threadIdx.x, nt = blockDim.x;
  const float* m = partial;
  const float* l = partial + static_cast<int64_t>(num_slots) * G;
  const float4* acc = reinterpret_cast<const float4*>(partial + acc_offset(num_slots, G));
  auto ld = [](const float* q) { return kCoherent ? __ldcg(q) : __ldg(q); };
  const int cols = G * D / 4;                      // float4 columns of acc per slot
  const int lanes = cols >= nt ? 1 : nt / cols;    // threads splitting one column's states
  const int span = nt / lanes;                     // columns per pass
  for (int c0 = 0; c0 < cols; c0 += span) {
    const int c = c0 + tid % span, r = tid / span;
    const int h = c / (D / 4);
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    float mr = -INFINITY, lr = 0.f;
    if (c < cols && r < lanes) {
      for (int s0 = r; s0 < n; s0 += kInFlight * lanes) {
        float4 v[kInFlight];
        float mu[kInFlight], lu[kInFlight];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          // Clamped (and skipped below) rather than branched: all loads issue back to back.
          const int64_t slot = slot_of(min(s0 + u * lanes, n - 1));
          v[u] = kCoherent ? __ldcg(acc + slot * cols + c) : __ldg(acc + slot * cols + c);
          mu[u] = ld(m + slot * G + h);
          lu[u] = ld(l + slot * G + h);
        }
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          if (s0 + u * lanes >= n) break;
          const float mx = fmaxf(mr, mu[u]);
          const float a = rescale(mr, mx), b = rescale(mu[u], mx);
          sum.x = sum.x * a + v[u].x * b; sum.y = sum.y * a + v[u].y * b;
          sum.z = sum.z * a + v[u].z * b; sum.w = sum.w * a + v[u].w * b;
          lr = lr * a + lu[u] * b;
          mr = mx;
        }
      }
    }
    if (lanes > 1) {
      s_red[tid] = sum;
      s_ml[tid] = make_float2(mr, lr);
      __syncthreads();
      if (r == 0 && c < cols)
        for (int k = 1; k < lanes; ++k) {
          const float4 o = s_red[k * span + tid];
          const float2 ml = s_ml[k * span + tid];
          const float mx = fmaxf(mr, ml.x);
          const float a = rescale(mr, mx), b = rescale(ml.x, mx);
          sum.x = sum.x * a + o.x * b; sum.y = sum.y * a + o.y * b;
          sum.z = sum.z * a + o.z * b; sum.w = sum.w * a + o.w * b;
          lr = lr * a + ml.y * b;
          mr = mx;
        }
      __syncthreads();
    }
    if (r == 0 && c < cols) {
      const float inv = 1.f / lr;
      Mma<T>::store2(out_heads + 4 * c, sum.x * inv, sum.y * inv);
      Mma<T>::store2(out_heads + 4 * c + 2, sum.z * inv, sum.w * inv);
    }
  }
}

}  // namespace pkv
