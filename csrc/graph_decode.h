// The graph decode: a paged-KV GQA decode whose work split is decided on the GPU.
//
// The grid is fixed by capacity (CTAs per SM x SMs), so one CUDA graph replays any step
// up to `num_rows` rows. Every CTA reads the step's lengths, cuts the step's work units into
// equal contiguous ranges (one per CTA; a unit is one tile of one KV head, and with
// piece_cost > 0 a segment shorter than a range also holds set-up units in front of its
// tiles, so that ranges are equal in tiles plus the pieces' set-ups), and attends over the
// (row, KV head) pieces its range covers. A piece that is a whole segment writes its output;
// a segment cut across CTAs leaves FP32 partial states, merged inside the same grid (one
// kernel, no second launch): by the segment's last CTA to count in on its counter when it has
// at most kCtaMergeStates states, else by the last kMergeSlices of its CTAs to count in, one
// slice of its columns each, the earlier of them spinning on the counter until every CTA has
// counted in (only in the last piece of a CTA's range). No host plan. Torch-free: binding.cpp
// unpacks tensors into these structs.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "pkv_decode.h"

namespace pkv {

constexpr int kGraphMaxRows = 1024;  // rows one step may hold (lengths are scanned in shared memory)
constexpr int kMaxPieceCost = 64;    // GraphDecodeParams::piece_cost's bound
constexpr int kMaxCounterStride = 32;  // GraphDecodeParams::counter_stride's bound
constexpr int kMaxSpinNs = 10000;      // GraphDecodeParams::spin_ns's bound
constexpr int kMaxQLen = 8;            // GraphDecodeParams::q_len's bound

struct GraphDecodeParams {
  const void* q;            // [num_rows, Hq, D]
  void* out;                // [num_rows, Hq, D]; rows of length 0 are not written
  const void* kv;           // K, the query's type or FP8 e4m3: element (page, head, token, d) at
                            // page * page_stride + head * head_stride + token * token_stride + d
  const void* v;            // V, same strides (our layout [num_pages, 2, Hkv, P, D]: K + Hkv * P * D)
  int64_t page_stride, head_stride, token_stride;  // elements; rows 16-byte aligned
  float* lse;               // null or [num_rows, Hq] FP32 natural-log LSE of the scaled (capped) logits
  float soft_cap_log2;      // logits soft cap times log2(e); 0 = off
  const float* page_scales; // FP8: null or [num_pages, 2, Hkv] factors on top of k_scale / v_scale
  const int* block_table;   // [R, bt_stride] physical page ids, indexed by request id
  int64_t bt_stride;
  const int* seq_lens;      // [num_rows]; 0 = padding row
  const int* req_ids;       // [num_rows] batch row -> block-table row
  float* partial;           // 2 states per CTA: m [S*G] | l [S*G] | acc [S*G*D], S = 2 * gridDim
  int* counters;            // [num_rows * Hkv * kMaxCounterStride], zero between launches (the merging
                            // CTA rearms it); segment (r, h)'s at (r * Hkv + h) * counter_stride
  int num_rows;             // <= kGraphMaxRows
  int num_kv_heads;
  int group;                // 1..kMaxGroup (<= 8 at head_dim 256)
  int page_shift;           // log2(page size)
  int num_ctas;             // grid size: the capacity the partial workspace was sized for
  int min_tiles;            // no CTA range shorter than this many tiles (while work allows)
  int piece_cost;           // set-up units in front of each segment shorter than a CTA's range
                            // (0..kMaxPieceCost; 0: the cut counts tiles only)
  int counter_stride;       // ints between two segments' merge counters (1..kMaxCounterStride; 1)
  int spin_ns;              // the mergers' spin back-off a poll, ns (0..kMaxSpinNs; 0: none)
  int short_tiles;          // a step of at most this many tiles a CTA over half the grid runs on half
                            // of it (graph_cut.cuh, active_ctas; 0: off)
  float scale_log2;         // log2(e) * sm_scale (1 / sqrt(D) by default)
  float k_scale, v_scale;   // FP8 tensor scales (1 for a 16-bit cache)
  // Queries (pkv.plan.device_schedule.Queries). q and out are [num_rows * q_len, Hq, D] (lse
  // [num_rows * q_len, Hq]): row r's token i at position seq_lens[r] - q_len + i reads the keys at
  // or before it and, with window_left >= 0, at or after it - window_left. A row's work is the
  // tiles covering [max(0, len - q_len - window_left), len). One pass holds q_block tokens (G x
  // q_block <= the MMA's rows): a row's tokens are q_blocks blocks, and segment (r, h) of the cut
  // is KV head h / q_blocks, block h % q_blocks (num_kv_heads x q_blocks segments a row).
  int window_left;          // -1: off
  int q_len;                // 1..kMaxQLen
  int q_block;              // query tokens of one pass (graph_query_block)
  int q_blocks;             // ceil(q_len / q_block)
  const float* sinks;       // null or [Hq] natural-log logits: exp(sink) joins a head's denominator once
};

// Query tokens one pass holds: as many of a row's q_len tokens as fit G x tokens in the MMA's
// rows (16, 8 at head_dim 256): pkv.plan.device_schedule.Queries.of.
inline int graph_query_block(int group, int head_dim, int q_len) {
  const int fit = (head_dim == 256 ? 8 : 16) / group;
  return fit < 1 ? 1 : (fit < q_len ? fit : q_len);
}

// Head dims built with an FP8 e4m3 cache (kFp8HeadDims in pkv/engines/graph.py).
constexpr int kFp8MaxHeadDim = 128;

// Diagnosis build knob (PKV_NVCC_FLAGS="-DPKV_TRACE=1", `pkv bench kernels --trace`): every
// CTA of the last launch stamps its phases (clock64, %globaltimer) into a device buffer of
// kTraceRecords records of kTraceFields u64: CTA j at record j (pkv.bench.kernels reads them).
// Off by default (no stamp is compiled).
#ifndef PKV_TRACE
#define PKV_TRACE 0
#endif
constexpr int kTraceFields = 16;
constexpr int kTraceCtas = 1024;  // above any grid (CTAs per SM x SMs)
constexpr int kTraceRecords = kTraceCtas;
// Copies the trace buffer to host memory dst (kTraceRecords * kTraceFields u64) and clears
// it; cudaErrorNotSupported in a build without PKV_TRACE.
cudaError_t read_graph_trace(unsigned long long* dst);

// CTAs per SM the kernel is built for at this head_dim (its shared-memory budget).
int graph_decode_ctas_per_sm(int head_dim);
// dtype: the query's (and output's); kv_fp8: the cache holds e4m3 bytes. pdl: launched as a
// programmatic dependent of the kernel queued before it (sm_90+): the lengths scan, the cut, the
// block-table loads and the copies of tokens before each row's newest run while that kernel
// drains; Q, the newest q_len tokens' K/V and every write wait for it. So the step's lengths, request
// ids, block table and its older tokens' K/V (and their page factors) must not be written by
// that kernel; false: an ordinary launch.
cudaError_t launch_graph_decode(const GraphDecodeParams& p, DType dtype, bool kv_fp8, int head_dim, bool pdl,
                                cudaStream_t stream);

}  // namespace pkv
