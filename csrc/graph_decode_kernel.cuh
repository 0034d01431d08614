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
  // A programmatic dependent (the next decode of a replayed graph, say) may launch once every CTA
  // is resident: it lands on the SMs of CTAs that exit (those with no work leave at once) and runs
  // its scan, cut and first old-token copies there; it reads or writes nothing this grid writes
  // before its griddep_wait. Every read before this grid's own wait (in the attend prologue) is
  // of the step's metadata and of tokens before the newest (Range::t_fresh).
  griddep_launch_dependents();
  unsigned long long* const rec = trace_begin();
  const int tid = threadIdx.x;
  // H: the cut's segments per row (KV heads x query blocks); a slot holds S_rows query rows.
  const int R = p.num_rows, H = segments_per_row(p), G = p.group, Hq = p.num_kv_heads * G;
  const int S_rows = G * p.q_block;

  // 1. The step's work: tiles per row (and set-up units), scanned.
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
  // The block-table line of this CTA's first pages is asked into L2 before the piece's set-up
  // (in-order work that would otherwise come before its page-id loads), so those loads find it
  // there. Row r has tiles (row_of skips empty rows); one line holds 32 ids.
  if (tid == 0) {
    const Piece first = piece_at(p, s_inc, s_len, H, lo, hi, r);
    const int t0 = (first_tile(s_len[first.r], p) + (first.tile_lo > 0 ? first.tile_lo : 0)) * kTile;
    prefetch_l2(p.block_table + static_cast<int64_t>(s_req[r]) * p.bt_stride + (t0 >> p.page_shift));
  }
  const int num_slots = 2 * p.num_ctas;
  float* part_m = p.partial;
  float* part_l = p.partial + static_cast<int64_t>(num_slots) * S_rows;
  float* part_acc = p.partial + acc_offset(num_slots, S_rows);
  PKV_STAMP(rec, 3);
  int pieces = 0, merged = 0, first_tokens = 0;

  for (int64_t u = lo; u < hi;) {
    const Piece pc = piece_at(p, s_inc, s_len, H, u, hi, r);
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
    const int len = s_len[r], ft = first_tile(len, p);
    const QueryRows qr = query_rows(p, r, h);  // segment h: KV head h / q_blocks, query block h % q_blocks
    const int kvh = h / p.q_blocks;
    const int64_t qo = qr.at(0) * D;

    Range a;
    a.kv = p.kv;
    a.bt = p.block_table + static_cast<int64_t>(s_req[r]) * p.bt_stride;
    a.q = reinterpret_cast<const T*>(p.q) + qo;
    a.head_off = static_cast<int64_t>(kvh) * p.head_stride;
    a.v_off = (static_cast<const char*>(p.v) - static_cast<const char*>(p.kv)) / (kFp8 ? 1 : 2);
    a.page_elems = p.page_stride;
    a.tok_stride = p.token_stride;
    a.cap_log2 = p.soft_cap_log2;
    a.page_shift = p.page_shift;
    a.t_begin = (ft + (tile_lo > 0 ? tile_lo : 0)) * kTile;
    a.t_end = min((ft + tile_hi) * kTile, len);
    a.valid_end = a.t_end;
    a.t_fresh = len - p.q_len;  // the newest tokens' K/V (the row's queries'): appended by the kernel before this one
    a.group = G;
    a.rows = qr.rows;
    a.q_tok_stride = static_cast<int64_t>(Hq) * D;
    a.pos0 = len - p.q_len + qr.first;
    a.window = p.window_left;
    a.scale_log2 = p.scale_log2 * p.k_scale;
    a.page_scales = p.page_scales;
    a.scale_head = kvh;
    a.num_kv_heads = p.num_kv_heads;
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
        const int64_t at = qr.at(hh);
        const float f = finish_state(mx, den, sink_log2(p.sinks, at % Hq));
        Mma<T>::store2(out + (at - qr.at(0)) * D + e % D, a0 * f, a1 * f);
        if (p.lse != nullptr && e % D == 0) p.lse[at] = lse_of(mx, den);
      });
      if (pieces == 1) PKV_STAMP(rec, 7);
    } else {
      attend([&](int e, int hh, float a0, float a1, float mx, float den) {
        *reinterpret_cast<float2*>(part_acc + static_cast<int64_t>(slot) * S_rows * D + e) = make_float2(a0, a1);
        if (e % D == 0) {
          part_m[slot * S_rows + hh] = mx;
          part_l[slot * S_rows + hh] = den;
        }
      });
      if (pieces == 1) PKV_STAMP(rec, 7);
      const int S = j1 - j0 + 1;
      // Publish the state, then count in (graph_merge.cuh: who merges). K = 1 (at most
      // kCtaMergeStates states): the last CTA to count in merges every column, waiting for
      // nobody. Else (`spread`): the e CTAs for which this piece ends their range take tickets t
      // (count in with 1); CTA j1, when pieces follow in its range, counts in with kLate and goes
      // on at once, since a wait there would hold its next pieces and, through them, the next
      // segments' mergers: one chain of waits through the grid. The last K of the e merge slice
      // t - (e - K), each after a spin until every CTA has counted in. The barrier orders every
      // thread's stores before thread 0's release (CUTLASS's semaphore); its acquire (the
      // atomic's, or the spin's load), then the barrier, orders the merger's loads after the
      // others' stores.
      const bool spread = !merged_in_cta(S);
      const int e = spread && floor_div((j1 + 1) * W, n) > seg_end ? S - 1 : S;  // j1's range goes on
      const bool late = e < S && j == j1;
      const int K = spread ? (e < kMergeSlices ? e : kMergeSlices) : 1, cols = qr.rows * D / 4;
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
        merge_slice<T, D, kMergeInFlight>(p, S, segment_slots(j0, seg_begin, W, n), k * cols / K,
                                          (k + 1) * cols / K, qr);
        // Rearmed for the next launch (and graph replay) once no merger still spins: each
        // counts in again, the one that brings the counter to all_in + K resets it.
        if (tid == 0 && (!spread || atomicAdd(counter, 1) == all_in + K - 1)) *counter = 0;
        ++merged;
      }
      __syncthreads();  // s_last is read before the next piece writes it
    }
    u = piece_end;
  }
  PKV_STAMP_DECODE_END(rec, pieces, merged, first_tokens);
}

}  // namespace
}  // namespace pkv
