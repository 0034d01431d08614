// The graph decode's merge of a segment cut across CTAs, inside the decode grid: who merges it,
// and merge_slice, the exact merge of the segment's partial states into its output. Included by graph_decode.cu
// only, through graph_decode_kernel.cuh.
#pragma once

#include "attend.cuh"
#include "graph_cut.cuh"

namespace pkv {
namespace {

// Who merges a segment cut across S CTAs (S partial states), inside the decode grid: a short
// one (S <= kCtaMergeStates) by its last CTA to count in on the segment's counter, every
// column, with one round of loads; a longer one by the last kMergeSlices of its CTAs to count
// in, one slice of its columns each, so that no CTA folds many states serially. The earlier of
// those mergers spin on the counter until every CTA has counted in; a CTA waits only in the
// last piece of its range, so at most kMergeSlices - 1 CTAs of a segment hold an SM waiting
// and no wait holds other work (docs/graph-decode.md: why it cannot hang or chain).
constexpr int kMergeThreads = kThreads;  // merge_slice runs on a decode CTA
// States a merging CTA loads per round: its registers are free by then.
constexpr int kMergeInFlight = 8;
#ifdef PKV_CTA_MERGE_STATES  // build knob (PKV_NVCC_FLAGS), for measuring alternatives
constexpr int kCtaMergeStates = PKV_CTA_MERGE_STATES;
#else
constexpr int kCtaMergeStates = 8;
#endif
#ifdef PKV_MERGE_SLICES  // build knob (PKV_NVCC_FLAGS), for measuring alternatives
constexpr int kMergeSlices = PKV_MERGE_SLICES;
#else
constexpr int kMergeSlices = 16;
#endif
// Whether a segment cut into `states` states is merged by its last CTA alone.
__device__ __forceinline__ bool merged_in_cta(int states) { return states <= kCtaMergeStates; }
// Diagnosis options of the spin (GraphDecodeParams): spin_ns > 0 backs the mergers' spin off
// by that many ns a poll (__nanosleep), and counter_stride puts segment (r, h)'s counter at
// (r * Hkv + h) * counter_stride ints (1: a row's counters share a line; 32: a line each). The
// counters are allocated for kMaxCounterStride.
__device__ __forceinline__ void spin_pause(int spin_ns) {
  if (spin_ns > 0) __nanosleep(static_cast<unsigned>(spin_ns));
}
// A late CTA's count-in: above any number of tickets and second count-ins (the grid is checked
// below it at launch), so a ticket is the counter's low bits.
constexpr int kLate = 1 << 16;

// The exact merge of one cut segment's `states` partial states (slots slot_of(0..states-1))
// into float4 columns [c_lo, c_hi) of its qr.rows * D outputs (and, where a slice holds a row's
// first column, that row's LSE); qr: the segment's query rows (graph_cut.cuh). A head's sink
// joins its denominator here, once (finish_state).
// A short segment's last CTA takes every column, each of a long segment's mergers one slice.
// The CTA's kMergeThreads threads split the columns and the states, load m, l and acc of kIF
// states together (one L2 round trip per round), fold them online and reduce a column's
// thread group by shuffles.
template <typename T, int D, int kIF>
__device__ __forceinline__ void merge_slice(const GraphDecodeParams& p, int states, SegmentSlots slot_of, int c_lo,
                                            int c_hi, const QueryRows& qr) {
  // G: a slot's row stride (G x q_block); cols: this segment's columns (its rows may be fewer)
  const int tid = threadIdx.x, G = p.group * p.q_block, cs = c_hi - c_lo, cols = G * D / 4;
  const int num_slots = 2 * p.num_ctas;
  const float* m = p.partial;
  const float* l = p.partial + static_cast<int64_t>(num_slots) * G;
  const float4* acc = reinterpret_cast<const float4*>(p.partial + acc_offset(num_slots, G));
  T* out = reinterpret_cast<T*>(p.out);
  auto fold = [](float& mx, float& den, float4& sum, float m2, float d2, float4 a2) {
    const float mn = fmaxf(mx, m2), w1 = rescale(mx, mn), w2 = rescale(m2, mn);
    den = w1 * den + w2 * d2;
    sum.x = w1 * sum.x + w2 * a2.x, sum.y = w1 * sum.y + w2 * a2.y;
    sum.z = w1 * sum.z + w2 * a2.z, sum.w = w1 * sum.w + w2 * a2.w;
    mx = mn;
  };
  auto store = [&](int c, float mx, float den, float4 sum) {
    const int64_t at = qr.at(c / (D / 4));
    const float inv = finish_state(mx, den, sink_log2(p.sinks, at % qr.hq));
    T* o = out + at * D + 4 * (c % (D / 4));
    Mma<T>::store2(o, sum.x * inv, sum.y * inv);
    Mma<T>::store2(o + 2, sum.z * inv, sum.w * inv);
    if (p.lse != nullptr && c % (D / 4) == 0) p.lse[at] = lse_of(mx, den);  // a row's first column
  };
  // Threads per column: a power of two <= 32 (aligned groups inside a warp, reduced by
  // shuffles), as many as the states while the slice's columns still fit the CTA.
  int lanes = 1;
  while (lanes < 32 && lanes < states && cs * lanes * 2 <= kMergeThreads) lanes <<= 1;
  if (lanes > 1) {  // one column per thread group (cs <= 64); the group splits the states
    const int c = c_lo + tid / lanes, part = tid & (lanes - 1);
    const bool live = c < c_hi;
    const int hh = live ? c / (D / 4) : 0;
    float mx = -INFINITY, den = 0.f;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = live ? part : states; s0 < states; s0 += kIF * lanes) {
      float ms[kIF], ls[kIF];
      float4 vs[kIF];
#pragma unroll
      for (int i = 0; i < kIF; ++i) {  // predicated: every load of the round issues at once
        const int s = s0 + i * lanes;
        ms[i] = -INFINITY, ls[i] = 0.f, vs[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (s < states) {
          const int64_t at = slot_of(s);
          ms[i] = __ldcg(m + at * G + hh);
          ls[i] = __ldcg(l + at * G + hh);
          vs[i] = __ldcg(acc + at * cols + c);
        }
      }
#pragma unroll
      for (int i = 0; i < kIF; ++i) fold(mx, den, sum, ms[i], ls[i], vs[i]);
    }
    for (int o = 1; o < lanes; o <<= 1) {  // the group's states, by shuffles (no barrier)
      const float m2 = __shfl_xor_sync(0xffffffffu, mx, o), d2 = __shfl_xor_sync(0xffffffffu, den, o);
      float4 a2;
      a2.x = __shfl_xor_sync(0xffffffffu, sum.x, o), a2.y = __shfl_xor_sync(0xffffffffu, sum.y, o);
      a2.z = __shfl_xor_sync(0xffffffffu, sum.z, o), a2.w = __shfl_xor_sync(0xffffffffu, sum.w, o);
      fold(mx, den, sum, m2, d2, a2);
    }
    if (live && part == 0) store(c, mx, den, sum);
  } else {  // wide slices (cs > 64): each thread owns columns c_lo + tid + 128 q, every state
    const int passes = (cs + kMergeThreads - 1) / kMergeThreads, items = passes * states;
    float mx = -INFINITY, den = 0.f;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    int q = 0, s = 0;  // the next item to fold: column pass q, state s
    for (int e0 = 0; e0 < items; e0 += kIF) {
      float ms[kIF], ls[kIF];
      float4 vs[kIF];
      int lq = q, ls_ = s;
#pragma unroll
      for (int i = 0; i < kIF; ++i) {  // this round's items, loads issued together
        const int c = c_lo + tid + lq * kMergeThreads;
        ms[i] = -INFINITY, ls[i] = 0.f, vs[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (e0 + i < items && c < c_hi) {
          const int64_t at = slot_of(ls_);
          const int hh = c / (D / 4);
          ms[i] = __ldcg(m + at * G + hh);
          ls[i] = __ldcg(l + at * G + hh);
          vs[i] = __ldcg(acc + at * cols + c);
        }
        if (++ls_ == states) ls_ = 0, ++lq;
      }
#pragma unroll
      for (int i = 0; i < kIF; ++i) {
        if (e0 + i < items) {
          fold(mx, den, sum, ms[i], ls[i], vs[i]);
          if (s == states - 1) {
            const int c = c_lo + tid + q * kMergeThreads;
            if (c < c_hi) store(c, mx, den, sum);
            mx = -INFINITY, den = 0.f, sum = make_float4(0.f, 0.f, 0.f, 0.f);
          }
          if (++s == states) s = 0, ++q;
        }
      }
    }
  }
}

}  // namespace
}  // namespace pkv
