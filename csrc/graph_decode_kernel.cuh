// The graph decode kernel: scan and cut (graph_cut.cuh), attend over the CTA's pieces
// (attend.cuh, attend_fp8.cuh), merge cut segments (graph_merge.cuh). graph_decode.h says what
// a launch computes; graph_decode.cu launches it. Included by graph_decode.cu only.
#pragma once

#include "attend_fp8.cuh"
#include "graph_cut.cuh"
#include "graph_merge.cuh"
#include "graph_trace.cuh"

namespace pkv {
namespace {

template <typename T, int D, int kRows, bool kFp8>
__global__ void __launch_bounds__(kThreads, AttendCfg<D, kFp8>::kCtasPerSm) graph_decode_kernel(const GraphDecodeParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_inc[kGraphMaxRows];  // inclusive prefix sum of tiles over rows
  __shared__ int s_len[kGraphMaxRows];
  __shared__ int s_req[kGraphMaxRows];  // loaded with the lengths: one dependent load less per piece
  __shared__ int s_warp[kWarps];
  __shared__ int s_nzw[kWarps];
  __shared__ int s_last;
  unsigned long long* const rec = trace_begin(0);
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
    trace_idle(rec);
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
  PKV_STAMP_DECODE_END(rec, pieces, merged, first_tokens);
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
  unsigned long long* const rec = trace_begin(kTraceCtas);
  (void)rec;
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
    trace_idle(rec);
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

}  // namespace
}  // namespace pkv
