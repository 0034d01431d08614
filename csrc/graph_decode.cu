// PersistentKV v4/v5 decode: device-decided splits; cut segments merged by the segment's last
// CTA (short ones), by a programmatic-dependent merge kernel (long ones, merge = 1, the default),
// or inside the grid by the segment's last CTAs (long ones, merge = 4).
// graph_decode.h says what the launch computes.
#include "graph_decode.h"

#include "attend_fp8.cuh"

namespace pkv {
namespace {

#if PKV_TRACE
__device__ unsigned long long g_trace[kTraceRecords * kTraceFields];
#endif

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

// A row's units per segment, scanned by a CTA of kThreadsT threads, each owning the kPer
// consecutive rows whose units it holds in units (tiles, or tiles and set-up units: scan_units):
// inc[i] = the thread's inclusive sum up to its row i, *before = the units of every earlier
// thread's rows, *total = all units, *nonzero = the rows with units. One __syncthreads (s_warp,
// s_nzw: kThreadsT / 32 each). The decode and the merge kernel both cut from it, so they agree
// by construction.
template <int kThreadsT, int kPer>
__device__ __forceinline__ void scan_rows(const int (&units)[kPer], int (&inc)[kPer], int* s_warp, int* s_nzw,
                                          int* before, int* total, int* nonzero) {
  constexpr int kW = kThreadsT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int run = 0, nz = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    run += units[i];
    nz += units[i] > 0;
    inc[i] = run;
  }
  int x = run;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) nz += __shfl_xor_sync(0xffffffffu, nz, o);
  if (lane == 31) s_warp[warp] = x;
  if (lane == 0) s_nzw[warp] = nz;
  __syncthreads();
  int b = x - run, t = 0, all_nz = 0;
#pragma unroll
  for (int w = 0; w < kW; ++w) {
    b += w < warp ? s_warp[w] : 0;
    t += s_warp[w];
    all_nz += s_nzw[w];
  }
  *before = b, *total = t, *nonzero = all_nz;
}

// floor(x / d) for x >= 0, d > 0: an unsigned 32-bit division whenever both fit (every step
// of up to ~16M work units), else the 64-bit one. (PKV_TRACE put the cut's emulated 64-bit
// divisions, ~300 clocks each in a dependent chain, before the first block-table load; a
// double quotient was slower still: docs/perf-notes.md, v5.)
__device__ __forceinline__ int64_t floor_div(int64_t x, int64_t d) {
  if (x <= 0xffffffffLL && d <= 0xffffffffLL) return static_cast<uint32_t>(x) / static_cast<uint32_t>(d);
  return x / d;
}

// A cut segment's states in merge order (pkv.plan.device_schedule.Cut.slots): CTA j0's piece
// (slot 2 j0 when j0's range starts in the segment, at it or in its set-up units, else
// 2 j0 + 1, its range's last piece), then each later CTA j0 + s's (slot 2 (j0 + s), the piece
// that starts its range).
struct SegmentSlots {
  int j0, first;
  __device__ __forceinline__ int operator()(int s) const { return s == 0 ? first : 2 * (j0 + s); }
};
__device__ __forceinline__ SegmentSlots segment_slots(int j0, int64_t seg_begin, int64_t W, int n) {
  return {j0, floor_div(j0 * W, n) >= seg_begin ? 2 * j0 : 2 * j0 + 1};
}

// CTAs that get work (pkv.device_schedule.active_ctas): at most the grid, no range under
// min_tiles; with fewer segments than CTAs, a multiple of the segment count (CTA ranges
// cut segments alike and no CTA straddles two).
__device__ __forceinline__ int active_ctas(int64_t W, int segments, const GraphDecodeParams& p) {
  const int64_t want = floor_div(W + p.min_tiles - 1, p.min_tiles);
  int n = static_cast<int>(want < p.num_ctas ? want : p.num_ctas);
  if (segments > 0 && segments <= n) n = n / segments * segments;
  return n;
}

__device__ __forceinline__ int tiles_of(int len) { return (len + kTile - 1) / kTile; }

// Row i's tiles of a thread's rows, from their inclusive prefix sums (where its lengths are
// no longer held in registers).
template <int kPer>
__device__ __forceinline__ int tiles_at(const int (&inc)[kPer], int i) { return inc[i] - (i > 0 ? inc[i - 1] : 0); }

// v5.9's set-up units of one row (pkv.plan.device_schedule.setup_units): `cost` in front of each
// segment of a row whose segments are shorter than a CTA's range (0 < tiles and tiles * n < W, W
// the tiles of every KV head, i.e. tiles < below = floor((W - 1) / n) + 1); cost = 0 when the step
// has none (scan_units). Two ints, not a per-row array: the d 128 merge kernel's register bound.
struct SetupUnits {
  int cost, below;
  __device__ __forceinline__ int of_tiles(int t) const { return t > 0 && t < below ? cost : 0; }
  __device__ __forceinline__ int of(int len) const { return of_tiles(tiles_of(len)); }
};

// The step's scan (pkv.plan.device_schedule.Cut): rows' tiles scanned (scan_rows) into inc,
// *before and *total, and *ctas = active_ctas of them. With piece_cost > 0 (v5.9), the cut's
// units also hold set-up units (*setup): row i's inclusive units are then inc[i] + the thread's
// set-up units up to its row i (the caller adds them, setup->of per row: no second per-row
// array, which spilled the d 128 merge kernel at its 56 registers), *before counts every earlier
// thread's, *vtotal all of them (without set-up units, *vtotal = *total). v5.12: the set-up
// units are a second scan of one count a thread, after the tiles' (their rule needs n, n needs
// the tiles' total), and only where a row qualifies: a block-wide vote (one barrier) skips it
// otherwise, so a step whose segments all span a range (every B1 step) pays one barrier more
// than piece_cost = 0, not v5.9's extra reduction.
template <int kThreadsT, int kPer>
__device__ __forceinline__ void scan_units(const GraphDecodeParams& p, const int (&len)[kPer], int (&inc)[kPer],
                                           int* s_warp, int* s_nzw, int* before, int* total, int* vtotal,
                                           int* nonzero, int* ctas, SetupUnits* setup) {
  int units[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) units[i] = tiles_of(len[i]);
  scan_rows<kThreadsT>(units, inc, s_warp, s_nzw, before, total, nonzero);
  const int64_t wt = static_cast<int64_t>(*total) * p.num_kv_heads;
  const int n = active_ctas(wt, *nonzero * p.num_kv_heads, p);
  *ctas = n, *vtotal = *total, *setup = SetupUnits{0, 0};
  if (p.piece_cost == 0 || wt == 0) return;
  const SetupUnits one{1, static_cast<int>(floor_div(wt - 1, n)) + 1};
  int count = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) count += one.of_tiles(tiles_at(inc, i));
  // The vote's barrier also orders every thread's reads of s_warp and s_nzw (the tiles' scan)
  // before the second scan's writes.
  if (!__syncthreads_or(count > 0)) return;
  // One count a thread: its warp's inclusive scan, the warps' totals through s_warp.
  constexpr int kW = kThreadsT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = count;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  int c_before = x - count, c_total = 0;
#pragma unroll
  for (int w = 0; w < kW; ++w) {
    c_before += w < warp ? s_warp[w] : 0;
    c_total += s_warp[w];
  }
  *before += p.piece_cost * c_before;
  *vtotal += p.piece_cost * c_total;
  *setup = SetupUnits{p.piece_cost, one.below};
}

// The decode's scan: every length and block-table row id loaded in one round, scanned
// (scan_units), then s_inc (inclusive prefix sum of units over rows), s_len and s_req in
// shared memory. Returns total tiles and, in *vtotal, the cut's units, in *nonzero, the rows
// of length > 0, in *ctas, the CTAs that get work.
template <int kThreadsT>
__device__ __forceinline__ int scan_step(const GraphDecodeParams& p, int* s_inc, int* s_len, int* s_req, int* s_warp,
                                         int* s_nzw, int* nonzero, int* vtotal, int* ctas, unsigned long long* rec) {
  constexpr int kPer = kGraphMaxRows / kThreadsT;
  const int tid = threadIdx.x, R = p.num_rows;
  int len[kPer], req[kPer], inc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {  // every load of the scan in one round
    const int r = tid * kPer + i;
    len[i] = r < R ? __ldg(p.seq_lens + r) : 0;
    req[i] = r < R ? __ldg(p.req_ids + r) : 0;
  }
  PKV_STAMP_AFTER(rec, 13, len[0] + req[0]);  // the lengths' round trip
  (void)rec;
  int before, total;
  SetupUnits setup;
  scan_units<kThreadsT>(p, len, inc, s_warp, s_nzw, &before, &total, vtotal, nonzero, ctas, &setup);
  int run = before;   // the set-up units before row r, and from v5.12 those of this thread's rows up to it
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int r = tid * kPer + i;
    run += setup.of(len[i]);
    if (r < R) {                              // nothing reads the rows past the step's
      s_inc[r] = run + inc[i];
      s_len[r] = len[i];
      s_req[r] = req[i];
    }
  }
  __syncthreads();
  return total;
}


// The piece of a CTA's range that starts at unit u (< hi): its row r (rows before `from` end at
// or before u), KV head h, segment [seg_begin, seg_end), end (the segment's or the range's),
// set-up units and tiles [tile_lo, tile_hi) (v5.9: after the set-up units; tile_hi <= 0: set-up
// units only, no piece).
struct Piece {
  int r, h, setup, tile_lo, tile_hi;
  int64_t seg_begin, seg_end, end;
};
__device__ __forceinline__ Piece piece_at(const int* s_inc, const int* s_len, int H, int64_t u, int64_t hi, int from) {
  Piece pc;
  int r = from;
  while (static_cast<int64_t>(H) * s_inc[r] <= u) ++r;
  const int exc = r ? s_inc[r - 1] : 0, units = s_inc[r] - exc;
  pc.r = r, pc.setup = units - tiles_of(s_len[r]);
  const int64_t row_base = static_cast<int64_t>(H) * exc;
  pc.h = static_cast<int>(static_cast<uint32_t>(u - row_base) / static_cast<uint32_t>(units));
  pc.seg_begin = row_base + static_cast<int64_t>(pc.h) * units, pc.seg_end = pc.seg_begin + units;
  pc.end = hi < pc.seg_end ? hi : pc.seg_end;
  pc.tile_lo = static_cast<int>(u - pc.seg_begin) - pc.setup;
  pc.tile_hi = static_cast<int>(pc.end - pc.seg_begin) - pc.setup;
  return pc;
}

// First row whose units end past unit u (binary search over the scanned prefix sums).
__device__ __forceinline__ int row_of(const int* s_inc, int R, int H, int64_t u) {
  int r = 0, r1 = R - 1;
  while (r < r1) {
    const int mid = (r + r1) >> 1;
    if (static_cast<int64_t>(H) * s_inc[mid] > u) r1 = mid; else r = mid + 1;
  }
  return r;
}

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

template <typename T, int D, int kRows, bool kFp8>
__global__ void __launch_bounds__(kThreads, AttendCfg<D, kFp8>::kCtasPerSm) graph_decode_kernel(const GraphDecodeParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_inc[kGraphMaxRows];  // inclusive prefix sum of tiles over rows
  __shared__ int s_len[kGraphMaxRows];
  __shared__ int s_req[kGraphMaxRows];  // loaded with the lengths: one dependent load less per piece
  __shared__ int s_warp[kWarps];
  __shared__ int s_nzw[kWarps];
  __shared__ int s_last;
#if PKV_TRACE
  unsigned long long* rec = g_trace + static_cast<int64_t>(blockIdx.x) * kTraceFields;
  if (threadIdx.x == 0 && blockIdx.x < kTraceCtas) rec[0] = globaltimer_ns();
  if (blockIdx.x >= kTraceCtas) rec = nullptr;
  PKV_STAMP(rec, 1);
#else
  unsigned long long* const rec = nullptr;
#endif
  // v5: let the merge kernel launch now (it scans the lengths while this grid runs and
  // waits for this grid's completion before it reads a state). merge = 2 (an ablation):
  // no early trigger, the merge grid launches as the decode CTAs exit.
  if (p.merge == 1 || p.merge == 3) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int tid = threadIdx.x;
  const int R = p.num_rows, H = p.num_kv_heads, G = p.group, Hq = H * G;

  // 1. The step's work: tiles per row (and set-up units, v5.9), scanned.
  int nonzero, vtotal, n;
  const int total = scan_step<kThreads>(p, s_inc, s_len, s_req, s_warp, s_nzw, &nonzero, &vtotal, &n, rec);
  PKV_STAMP(rec, 2);

  // 2. This CTA's range of work units (unit = one tile of one KV head, or a set-up unit in
  //    front of a short segment's tiles; segment (r, h) holds units [H*exc_r + h*u_r, +u_r),
  //    u_r = its tiles and set-up units). Balanced to one unit; the CTA count is the tiles'.
  const int64_t W = static_cast<int64_t>(vtotal) * H;
  const int j = blockIdx.x;
  if (j >= n) {
#if PKV_TRACE
    if (rec != nullptr && tid == 0) rec[9] = globaltimer_ns(), rec[10] = 0;
#endif
    return;
  }
  const int64_t lo = floor_div(j * W, n), hi = floor_div((j + 1) * W, n);
  auto cta_of = [&](int64_t u) { return static_cast<int>(floor_div((u + 1) * n - 1, W)); };  // CTA whose range holds u

  int r = row_of(s_inc, R, H, lo);
  // v5.4: the block-table line of this CTA's first pages is asked into L2 before the piece's
  // set-up (in-order work that came before its page-id loads: ~1.4 us at B1 1K, docs/perf-notes.md),
  // so those loads find it there. Row r has tiles (row_of skips empty rows); one line holds 32 ids.
  if (tid == 0) {
    const Piece first = piece_at(s_inc, s_len, H, lo, hi, r);
    const int t0 = (first.tile_lo > 0 ? first.tile_lo : 0) * kTile;
    prefetch_l2(p.block_table + static_cast<int64_t>(s_req[r]) * p.bt_stride + (t0 >> p.page_shift));
  }
  const int num_slots = 2 * p.num_ctas;
  float* part_m = p.partial;
  float* part_l = p.partial + static_cast<int64_t>(num_slots) * G;
  float* part_acc = p.partial + acc_offset(num_slots, G);
  PKV_STAMP(rec, 3);
  int pieces = 0, merged = 0, first_tokens = 0;

  for (int64_t u = lo; u < hi;) {
    const Piece pc = piece_at(s_inc, s_len, H, u, hi, r);
    r = pc.r;
    const int h = pc.h, setup = pc.setup, tile_lo = pc.tile_lo, tile_hi = pc.tile_hi;
    const int64_t seg_begin = pc.seg_begin, seg_end = pc.seg_end, piece_end = pc.end;
    if (tile_hi <= 0) {  // set-up units only: no piece
      u = piece_end;
      continue;
    }
    const int j0 = cta_of(seg_begin + setup), j1 = cta_of(seg_end - 1);  // the CTAs holding its tiles
    // A segment's first CTA stores its piece in slot 2j0 when its range starts in the
    // segment, else 2j0 + 1 (its last piece); every later CTA's piece starts its range: slot 2j.
    const int slot = u == lo ? 2 * j : 2 * j + 1;
    const int64_t qo = (static_cast<int64_t>(r) * Hq + h * G) * D;

    Range a;
    a.kv = p.kv;
    a.bt = p.block_table + static_cast<int64_t>(s_req[r]) * p.bt_stride;
    a.q = reinterpret_cast<const T*>(p.q) + qo;
    a.head_off = static_cast<int64_t>(h) * p.head_stride;
    a.v_off = (static_cast<const char*>(p.v) - static_cast<const char*>(p.kv)) / (kFp8 ? 1 : 2);
    a.page_elems = p.page_stride;
    a.tok_stride = p.token_stride;
    a.cap_log2 = p.soft_cap_log2;
    a.page_shift = p.page_shift;
    a.t_begin = (tile_lo > 0 ? tile_lo : 0) * kTile;
    a.t_end = min(tile_hi * kTile, s_len[r]);
    a.valid_end = a.t_end;
    a.group = G;
    a.scale_log2 = p.scale_log2 * p.k_scale;
    a.page_scales = p.page_scales;
    a.scale_head = h;
    a.num_kv_heads = H;
    a.out_scale = p.v_scale;
    a.trace = pieces == 0 ? rec : nullptr;
    if (pieces == 0) first_tokens = a.t_end - a.t_begin;
    ++pieces;

    T* out = reinterpret_cast<T*>(p.out) + qo;
    auto attend = [&](auto&& emit) {
      if constexpr (kFp8) attend_range_fp8<T, D, kRows>(a, smem, emit);
      else attend_range<T, D, kRows>(a, smem, emit);
    };
    if (j0 == j1) {
      attend([&](int e, int hh, float a0, float a1, float mx, float den) {
        Mma<T>::store2(out + e, a0 / den, a1 / den);
        if (p.lse != nullptr && e % D == 0) p.lse[qo / D + hh] = lse_of(mx, den);
      });
      if (pieces == 1) PKV_STAMP(rec, 7);
    } else {
      attend([&](int e, int hh, float a0, float a1, float mx, float den) {
        *reinterpret_cast<float2*>(part_acc + static_cast<int64_t>(slot) * G * D + e) = make_float2(a0, a1);
        if (e % D == 0) {
          part_m[slot * G + hh] = mx;
          part_l[slot * G + hh] = den;
        }
      });
      if (pieces == 1) PKV_STAMP(rec, 7);
      const int S = j1 - j0 + 1;
      if (merged_in_grid(S, p.merge)) {
        // Publish the state, then count in. K = 1 (at most kCtaMergeStates states): the last CTA
        // to count in merges every column, waiting for nobody. Else (merge = 4, `spread`): the e
        // CTAs for which this piece ends their range take tickets t (count in with 1); CTA j1,
        // when pieces follow in its range, counts in with kLate and goes on at once, since a wait
        // there would hold its next pieces and, through them, the next segments' mergers: one
        // chain through the grid (the reference run at 404ef14: 1.7 ms against 0.14 at B4 33K,
        // docs/perf-notes.md, v5.8). The last K of the e merge slice t - (e - K), each after a
        // spin until every CTA has counted in. The barrier orders every thread's stores before
        // thread 0's release (CUTLASS's semaphore); its acquire (the atomic's, or the spin's
        // load), then the barrier, orders the merger's loads after the others' stores.
        const bool spread = !merged_in_cta(S, p.merge);
        const int e = spread && floor_div((j1 + 1) * W, n) > seg_end ? S - 1 : S;  // j1's range goes on
        const bool late = e < S && j == j1;
        const int K = spread ? (e < kMergeSlices ? e : kMergeSlices) : 1, cols = G * D / 4;
        const int all_in = e + (S - e) * kLate;  // the counter once every CTA has counted in
        __syncthreads();
        int* counter = p.counters + static_cast<int64_t>(r * H + h) * p.counter_stride;
        if (tid == 0) {
          const int t = atomic_add_acq_rel(counter, late ? kLate : 1) & (kLate - 1);
          const int k = late ? -1 : t - (e - K);
          if (spread && k >= 0)
            while (ld_acquire(counter) < all_in) spin_pause(p.spin_ns);
          s_last = k;
        }
        __syncthreads();
        const int k = s_last;
        if (k >= 0) {
          merge_slice<T, D, kLastCtaInFlight>(p, S, segment_slots(j0, seg_begin, W, n), k * cols / K,
                                              (k + 1) * cols / K, static_cast<int>(qo / D));
          // Rearmed for the next launch (and graph replay) once no merger still spins: each
          // counts in again, the one that brings the counter to all_in + K resets it.
          if (tid == 0 && (!spread || atomicAdd(counter, 1) == all_in + K - 1)) *counter = 0;
          ++merged;
        }
        __syncthreads();  // s_last is read before the next piece writes it
      }
    }
    u = piece_end;
  }
#if PKV_TRACE
  if (rec != nullptr && tid == 0) {
    rec[8] = clock_now();
    rec[9] = globaltimer_ns();
    rec[10] = 1 | (static_cast<unsigned long long>(pieces) << 8) | (static_cast<unsigned long long>(merged) << 24);
    rec[11] = static_cast<unsigned long long>(first_tokens);
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(smid));
    rec[12] = smid;
  }
#endif
  (void)merged, (void)first_tokens;
}

// v5 merge, a programmatic dependent of the decode grid. Merge CTA j repeats the decode's
// cut (same lengths, same rule) before waiting, so its job is known when the states land:
// the segment holding unit lo_j, when that segment is cut across CTAs j0..j1 and j > j0.
// Each of the CTAs j0+1..j1 of a cut segment merges one of j1 - j0 equal slices of the
// segment's G * D / 4 float4 columns; its threads split the slice's columns and the
// segment's j1 - j0 + 1 states, load m, l and acc of a round of states together, fold them
// online and reduce a column's thread group by shuffles. The CTA keeps no per-row array
// (its row is found from the prefix sums in registers): ~100 B of shared memory, so merge
// CTAs stay resident beside a full decode grid (MergeCfg).
template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads, MergeCfg<D>::kMinBlocks) graph_merge_kernel(const GraphDecodeParams p) {
  constexpr int kW = kMergeThreads / 32, kPer = kGraphMaxRows / kMergeThreads;
  __shared__ int s_warp[kW], s_nzw[kW], s_job[3];  // s_job: row, units before it, its units
#if PKV_TRACE
  unsigned long long* rec = g_trace + static_cast<int64_t>(kTraceCtas + blockIdx.x) * kTraceFields;
  if (threadIdx.x == 0 && blockIdx.x < kTraceCtas) rec[0] = globaltimer_ns();
  if (blockIdx.x >= kTraceCtas) rec = nullptr;
  PKV_STAMP(rec, 1);
#else
  unsigned long long* const rec = nullptr;
  (void)rec;
#endif
  const int tid = threadIdx.x, R = p.num_rows;
  const int H = p.num_kv_heads, G = p.group, Hq = H * G;
  // The decode's scan (scan_rows), keeping each thread's inclusive prefix sums in registers.
  int len[kPer], inc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int r = tid * kPer + i;
    len[i] = r < R ? __ldg(p.seq_lens + r) : 0;
  }
  if (tid == 0) s_job[0] = -1;  // ordered before the readers by scan_rows' barrier
  int before, total, vtotal, all_nz, n;
  SetupUnits setup;
  scan_units<kMergeThreads>(p, len, inc, s_warp, s_nzw, &before, &total, &vtotal, &all_nz, &n, &setup);
  const int64_t W = static_cast<int64_t>(vtotal) * H;
  const int j = blockIdx.x;
  const int64_t lo = j > 0 && j < n ? floor_div(j * W, n) : -1;
  if (lo >= 0) {  // the row whose units hold lo: exactly one (row, thread) sees it
    int prev = before, run = before;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      run += setup.of_tiles(tiles_at(inc, i));
      const int cur = run + inc[i];
      if (static_cast<int64_t>(H) * prev <= lo && lo < static_cast<int64_t>(H) * cur)
        s_job[0] = tid * kPer + i, s_job[1] = prev, s_job[2] = cur - prev;
      prev = cur;
    }
  }
  __syncthreads();
  bool job = s_job[0] >= 0;
  int r = 0, h = 0, j0 = 0, j1 = 0, first = 0;
  if (job) {
    r = s_job[0];
    const int exc = s_job[1], units = s_job[2];
    // Its set-up units (v5.9): its length read again (an L2 hit) rather than held in registers.
    const int setup = p.piece_cost > 0 ? units - tiles_of(__ldg(p.seq_lens + r)) : 0;
    const int64_t row_base = static_cast<int64_t>(H) * exc;
    h = static_cast<int>(static_cast<uint32_t>(lo - row_base) / static_cast<uint32_t>(units));
    const int64_t seg_begin = row_base + static_cast<int64_t>(h) * units, seg_end = seg_begin + units;
    j0 = static_cast<int>(floor_div((seg_begin + setup + 1) * n - 1, W));  // the CTA holding its first tile
    j1 = static_cast<int>(floor_div(seg_end * n - 1, W));
    first = segment_slots(j0, seg_begin, W, n).first;
    job = j0 < j1 && j > j0 && !merged_in_grid(j1 - j0 + 1, p.merge);
  }
  PKV_STAMP(rec, 2);
  if (!job) {
    // Nothing of the decode's to read, but this grid must not complete before the decode: a
    // kernel queued after it (a PDL consumer's griddepcontrol.wait included) is ordered by
    // this grid's completion, and reads `out`. One CTA waiting keeps that; the rest exit.
    if (blockIdx.x == 0) asm volatile("griddepcontrol.wait;\n" ::: "memory");
#if PKV_TRACE
    if (rec != nullptr && tid == 0) rec[9] = globaltimer_ns(), rec[10] = 0;
#endif
    return;
  }
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the decode grid is complete, its states visible
  PKV_STAMP(rec, 3);
  {
    const int slices = j1 - j0, k = j - j0 - 1, cols = G * D / 4;
    merge_slice<T, D, MergeCfg<D>::kInFlight>(p, j1 - j0 + 1, SegmentSlots{j0, first}, k * cols / slices,
                                              (k + 1) * cols / slices, r * Hq + h * G);
  }
#if PKV_TRACE
  if (rec != nullptr && tid == 0) {
    rec[4] = clock_now();
    rec[9] = globaltimer_ns();
    rec[10] = 1 | (static_cast<unsigned long long>(j1 - j0 + 1) << 8);
  }
#endif
}

template <typename T, int D, int kRows, bool kFp8>
cudaError_t launch_typed(const GraphDecodeParams& p, cudaStream_t stream) {
  auto kernel = graph_decode_kernel<T, D, kRows, kFp8>;
  constexpr int smem = AttendCfg<D, kFp8>::kSmemTotal;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  kernel<<<p.num_ctas, kThreads, smem, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.merge == 0 || p.merge == 4) return err;  // no merge kernel
  // The merge as a programmatic dependent: launched once every decode CTA has started (it
  // overlaps the decode), released by griddepcontrol.wait when the decode grid completes.
  return launch_dependent_merge(graph_merge_kernel<T, D>, dim3(p.num_ctas), dim3(kMergeThreads), stream, p);
}

template <typename T, int D, bool kFp8>
cudaError_t launch_group(const GraphDecodeParams& p, cudaStream_t stream) {
  if (p.group <= 8) return launch_typed<T, D, 1, kFp8>(p, stream);
  if constexpr (D <= 128) return launch_typed<T, D, 2, kFp8>(p, stream);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_dim(const GraphDecodeParams& p, bool kv_fp8, int head_dim, cudaStream_t stream) {
  if (kv_fp8) {
    static_assert(kFp8MaxHeadDim == 128, "FP8 builds head_dim 64 and 128");
    switch (head_dim) {
      case 64: return launch_group<T, 64, true>(p, stream);
      case 128: return launch_group<T, 128, true>(p, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (head_dim) {
    case 64: return launch_group<T, 64, false>(p, stream);
    case 128: return launch_group<T, 128, false>(p, stream);
    case 256: return launch_group<T, 256, false>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int graph_decode_ctas_per_sm(int head_dim) {
  return head_dim == 64 ? AttendCfg<64>::kCtasPerSm : head_dim == 128 ? AttendCfg<128>::kCtasPerSm
                                                                      : AttendCfg<256>::kCtasPerSm;
}

cudaError_t launch_graph_decode(const GraphDecodeParams& p, DType dtype, bool kv_fp8, int head_dim,
                                cudaStream_t stream) {
  if (p.group < 1 || p.group > kMaxGroup || p.num_rows < 1 || p.num_rows > kGraphMaxRows || p.num_ctas < 1 ||
      p.num_ctas >= kLate - kMergeSlices || p.min_tiles < 1 || p.merge < 0 || p.merge > 4 ||
      p.piece_cost < 0 || p.piece_cost > kMaxPieceCost || p.counter_stride < 1 ||
      p.counter_stride > kMaxCounterStride || p.spin_ns < 0 || p.spin_ns > kMaxSpinNs ||
      (p.page_scales != nullptr && (!kv_fp8 || (1 << p.page_shift) < kChunk)))
    return cudaErrorInvalidValue;
  return dtype == DType::kFloat16 ? launch_dim<__half>(p, kv_fp8, head_dim, stream)
                                  : launch_dim<__nv_bfloat16>(p, kv_fp8, head_dim, stream);
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
