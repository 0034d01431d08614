// The graph decode's merge of a segment cut across CTAs: who merges it, and merge_slice, the
// exact merge of the segment's partial states into its output. Included by graph_decode.cu
// only, through graph_decode_kernel.cuh.
#pragma once

#include "graph_cut.cuh"
#include "attend.cuh"

namespace pkv {
namespace {

constexpr int kMergeThreads = 128;
static_assert(kMergeThreads == kThreads, "the last-CTA merge runs merge_slice on a decode CTA");
// States a decode CTA's merge loads per round (its last-CTA and in-grid merges): its
// registers are free by then.
constexpr int kLastCtaInFlight = 8;

// v5.7 (merge = 1): a cut segment of at most kCtaMergeStates states is merged by its last CTA
// (one round of loads after the counter), a longer one by the merge kernel's CTAs in slices (one
// CTA's serial merge of 32 states cost ~9 us at B1 4K: docs/perf-notes.md, v5.6). Merge CTAs
// without a job exit at once, but for CTA 0, which waits for the decode grid so that the merge
// grid never completes before it (v5.7.1).
#ifdef PKV_CTA_MERGE_STATES  // build knob (PKV_NVCC_FLAGS), for measuring alternatives
constexpr int kCtaMergeStates = PKV_CTA_MERGE_STATES;
#else
constexpr int kCtaMergeStates = 8;
#endif
// Whether a segment cut into `states` states is merged by its last decode CTA (both kernels
// decide it alike): always under merge = 0, short segments under merge = 1 and 4, never under
// 2 and 3.
__device__ __forceinline__ bool merged_in_cta(int states, int merge) {
  return merge == 0 || ((merge == 1 || merge == 4) && states <= kCtaMergeStates);
}
// Whether the decode grid merges such a segment itself (its last CTA, or under merge = 4
// its last kMergeSlices CTAs); the rest are the merge kernel's.
__device__ __forceinline__ bool merged_in_grid(int states, int merge) {
  return merge == 4 || merged_in_cta(states, merge);
}
// v5.8 (merge = 4): a longer segment is merged inside the decode grid by the last
// kMergeSlices of its CTAs to count in, one slice of its columns each, no second kernel. The
// earlier of them wait for the rest to count in (a spin on the segment's counter); only the
// last few arrivals wait, and only in the last piece of their range, so at most
// kMergeSlices - 1 CTAs of a segment ever hold an SM waiting and no wait holds other work
// (docs/graph-decode.md: why it cannot hang or chain).
#ifdef PKV_MERGE_SLICES  // build knob (PKV_NVCC_FLAGS), for measuring alternatives
constexpr int kMergeSlices = PKV_MERGE_SLICES;
#else
constexpr int kMergeSlices = 16;
#endif
// Two diagnosis options of merge = 4 (docs/perf-notes.md, v5.8: its long-cut rows were
// 0.5-0.7 us slower than the merge kernel's; the guess is the counter's line): spin_ns > 0
// backs the mergers' spin off by that many ns a poll (__nanosleep), and counter_stride puts
// segment (r, h)'s counter at (r * Hkv + h) * counter_stride ints (1: a row's counters share a
// line; 32: a line each). The counters are allocated for kMaxCounterStride.
__device__ __forceinline__ void spin_pause(int spin_ns) {
  if (spin_ns > 0) __nanosleep(static_cast<unsigned>(spin_ns));
}
// A late CTA's count-in (merge = 4): above any number of tickets and second count-ins (the
// grid is checked below it at launch), so a ticket is the counter's low bits.
constexpr int kLate = 1 << 16;
// Merge kernel registers: at d 128 two merge CTAs (<= 64 registers: 2 x 8192 beside the two
// decode CTAs' 2 x 23552 at their 180, of 65536) fit beside a full grid of two decode CTAs per
// SM, so they are resident (their scan overlapping the decode) and load 3 states a round (4
// spilled at v5.7's 56-register bound; v5.12's set-up scan needed more than 56); at d 64 none
// fits beside three decode CTAs and at d 256 several do, so there they take 8 a round.
template <int D> struct MergeCfg {
  static constexpr int kInFlight = D == 128 ? 3 : 8;
  static constexpr int kMinBlocks = D == 128 ? 8 : 4;
};

// The exact merge of one cut segment's `states` partial states (slots slot_of(0..states-1))
// into float4 columns [c_lo, c_hi) of its G * D outputs (and, where a slice holds a head's
// first column, that head's LSE); out_at = the segment's first query head (r * Hq + h * G).
// One definition for both merges: a v5 merge CTA takes one slice of its segment, the last
// CTA of a segment (merge = 0) takes every column. The CTA's kMergeThreads threads split
// the columns and the states, load m, l and acc of kIF states together (one L2 round trip
// per round), fold them online and reduce a column's thread group by shuffles.
template <typename T, int D, int kIF>
__device__ __forceinline__ void merge_slice(const GraphDecodeParams& p, int states, SegmentSlots slot_of, int c_lo,
                                            int c_hi, int out_at) {
  const int tid = threadIdx.x, G = p.group, cs = c_hi - c_lo, cols = G * D / 4;
  const int num_slots = 2 * p.num_ctas;
  const float* m = p.partial;
  const float* l = p.partial + static_cast<int64_t>(num_slots) * G;
  const float4* acc = reinterpret_cast<const float4*>(p.partial + acc_offset(num_slots, G));
  T* out = reinterpret_cast<T*>(p.out) + static_cast<int64_t>(out_at) * D;
  auto fold = [](float& mx, float& den, float4& sum, float m2, float d2, float4 a2) {
    const float mn = fmaxf(mx, m2), w1 = rescale(mx, mn), w2 = rescale(m2, mn);
    den = w1 * den + w2 * d2;
    sum.x = w1 * sum.x + w2 * a2.x, sum.y = w1 * sum.y + w2 * a2.y;
    sum.z = w1 * sum.z + w2 * a2.z, sum.w = w1 * sum.w + w2 * a2.w;
    mx = mn;
  };
  auto store = [&](int c, float mx, float den, float4 sum) {
    const float inv = 1.f / den;
    Mma<T>::store2(out + 4 * c, sum.x * inv, sum.y * inv);
    Mma<T>::store2(out + 4 * c + 2, sum.z * inv, sum.w * inv);
    if (p.lse != nullptr && c % (D / 4) == 0) p.lse[out_at + c / (D / 4)] = lse_of(mx, den);  // a head's first column
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
