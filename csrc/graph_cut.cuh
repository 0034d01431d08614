// The graph decode's device-side split rule: every CTA scans the step's lengths, cuts the
// step's work units into equal contiguous ranges, one per CTA, and finds the (row, KV head)
// pieces of its range. pkv.plan.device_schedule is the same rule in Python (the CPU oracle).
// Included by graph_decode.cu only, through graph_decode_kernel.cuh.
#pragma once

#include "attend.cuh"
#include "graph_decode.h"

namespace pkv {
namespace {

// A row's units per segment, scanned by a CTA of kThreadsT threads, each owning the kPer
// consecutive rows whose units it holds in units (tiles, or tiles and set-up units: scan_units):
// inc[i] = the thread's inclusive sum up to its row i, *before = the units of every earlier
// thread's rows, *total = all units, *nonzero = the rows with units. One __syncthreads (s_warp,
// s_nzw: kThreadsT / 32 each). Every CTA cuts from it, so they agree by construction.
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
// of up to ~16M work units), else the 64-bit one: the cut's divisions form a dependent chain
// before the first block-table load, and an emulated 64-bit division is a few hundred clocks
// (a double quotient is slower still).
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

// CTAs that get work (pkv.plan.device_schedule.grid_ctas): at most the grid, no range under
// min_tiles; a short step (at most p.short_tiles tiles a CTA over half the grid) on at most half
// of it, so that the next call's CTAs find free SMs to start on (under PDL: to scan, cut and
// issue their first copies) while this one finishes; with fewer segments than CTAs, a multiple
// of the segment count (CTA ranges cut segments alike and no CTA straddles two).
__device__ __forceinline__ int active_ctas(int64_t W, int segments, const GraphDecodeParams& p) {
  const int64_t want = floor_div(W + p.min_tiles - 1, p.min_tiles);
  int n = static_cast<int>(want < p.num_ctas ? want : p.num_ctas);
  const int half = p.num_ctas > 1 ? p.num_ctas / 2 : 1;
  if (n > half && W <= static_cast<int64_t>(p.short_tiles) * half) n = half;
  if (segments > 0 && segments <= n) n = n / segments * segments;
  return n;
}

__device__ __forceinline__ int tiles_of(int len) { return (len + kTile - 1) / kTile; }

// A row's first tile: the one holding max(0, len - q_len - window_left), the first key any of its
// queries reads (0 without a window); tiles stay aligned to kTile positions.
__device__ __forceinline__ int first_tile(int len, const GraphDecodeParams& p) {
  if (p.window_left < 0) return 0;
  const int t = len - p.q_len - p.window_left;
  return t > 0 ? t / kTile : 0;
}
// A row's work in tiles (pkv.plan.device_schedule.Queries.tiles): those covering its window.
__device__ __forceinline__ int row_tiles(int len, const GraphDecodeParams& p) { return tiles_of(len) - first_tile(len, p); }
// Segments per row in the cut: KV heads x query blocks.
__device__ __forceinline__ int segments_per_row(const GraphDecodeParams& p) { return p.num_kv_heads * p.q_blocks; }

// The query rows of segment h of row r (KV head h / q_blocks, query block h % q_blocks): rows
// query rows (G x its tokens) from token `first` of the row; MMA row m is token first + m / G,
// head m % G of the KV head, at row at(m) of q, out ([num_rows * q_len, Hq]) and lse.
struct QueryRows {
  int64_t base;   // q's row (of Hq heads) of the segment's first token
  int head0;      // its first query head: kv head * G
  int group, hq, first, rows;
  __device__ __forceinline__ int64_t at(int m) const { return (base + m / group) * hq + head0 + m % group; }
};
__device__ __forceinline__ QueryRows query_rows(const GraphDecodeParams& p, int r, int h) {
  const int b = h % p.q_blocks, first = b * p.q_block;
  const int tokens = min(p.q_len - first, p.q_block);
  return {static_cast<int64_t>(r) * p.q_len + first, (h / p.q_blocks) * p.group, p.group,
          p.num_kv_heads * p.group, first, tokens * p.group};
}

// Row i's tiles of a thread's rows, from their inclusive prefix sums (where its lengths are
// no longer held in registers).
template <int kPer>
__device__ __forceinline__ int tiles_at(const int (&inc)[kPer], int i) { return inc[i] - (i > 0 ? inc[i - 1] : 0); }

// The set-up units of one row (pkv.plan.device_schedule.setup_units): `cost` in front of each
// segment of a row whose segments are shorter than a CTA's range (0 < tiles and tiles * n < W, W
// the tiles of every KV head, i.e. tiles < below = floor((W - 1) / n) + 1); cost = 0 when the step
// has none (scan_units). Two ints, not a per-row array (registers).
struct SetupUnits {
  int cost, below;
  __device__ __forceinline__ int of_tiles(int t) const { return t > 0 && t < below ? cost : 0; }
};

// The step's scan (pkv.plan.device_schedule.Cut): rows' tiles scanned (scan_rows) into inc,
// *before and *total, and *ctas = active_ctas of them. With piece_cost > 0, the cut's units
// also hold set-up units (*setup): row i's inclusive units are then inc[i] + the thread's
// set-up units up to its row i (the caller adds them, setup->of per row: no second per-row
// array), *before counts every earlier thread's, *vtotal all of them (without set-up units,
// *vtotal = *total). The set-up units are a second scan of one count a thread, after the
// tiles' (their rule needs n, n needs the tiles' total), and only where a row qualifies: a
// block-wide vote (one barrier) skips it otherwise, so a step whose segments all span a range
// (every B1 step) pays one barrier more than piece_cost = 0.
template <int kThreadsT, int kPer>
__device__ __forceinline__ void scan_units(const GraphDecodeParams& p, const int (&len)[kPer], int (&inc)[kPer],
                                           int* s_warp, int* s_nzw, int* before, int* total, int* vtotal,
                                           int* nonzero, int* ctas, SetupUnits* setup) {
  int units[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) units[i] = row_tiles(len[i], p);
  scan_rows<kThreadsT>(units, inc, s_warp, s_nzw, before, total, nonzero);
  const int64_t wt = static_cast<int64_t>(*total) * segments_per_row(p);
  const int n = active_ctas(wt, *nonzero * segments_per_row(p), p);
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
  int run = before;   // the set-up units of earlier threads' rows, then of this thread's rows up to row r
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int r = tid * kPer + i;
    run += setup.of_tiles(row_tiles(len[i], p));
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
// or before u), segment h of the row (H = segments_per_row), segment [seg_begin, seg_end), end (the segment's or the range's),
// set-up units and tiles [tile_lo, tile_hi) (after the set-up units, counted from the row's
// first_tile; tile_hi <= 0: set-up units only, no piece).
struct Piece {
  int r, h, setup, tile_lo, tile_hi;
  int64_t seg_begin, seg_end, end;
};
__device__ __forceinline__ Piece piece_at(const GraphDecodeParams& p, const int* s_inc, const int* s_len, int H,
                                          int64_t u, int64_t hi, int from) {
  Piece pc;
  int r = from;
  while (static_cast<int64_t>(H) * s_inc[r] <= u) ++r;
  const int exc = r ? s_inc[r - 1] : 0, units = s_inc[r] - exc;
  pc.r = r, pc.setup = units - row_tiles(s_len[r], p);
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

}  // namespace
}  // namespace pkv
