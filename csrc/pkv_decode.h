// PersistentKV split decode over a native block table: launcher API.
// Torch-free on purpose: the kernels build with plain nvcc (tests/test_csrc_compile.py)
// and the torch binding (binding.cpp) only unpacks tensors into these structs.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace pkv {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// How a decode CTA leaves its result.
enum class OutMode : int {
  kDirect = 0,   // the CTA owns its whole (row, kv head): write the normalized output
  kPartial = 1,  // write the FP32 partial state (m, l, acc) to its slot; a merge launch follows
  kFused = 2,    // write the partial state; the last CTA of a segment merges (atomic counter)
  kCluster = 3,  // grid mode, one thread-block cluster per segment (cluster size = splits <= 16):
                 // states stay in shared memory, merged across the cluster (no merge launch)
};

constexpr int kMaxClusterSplits = 16;  // Hopper's largest (non-portable) cluster

#ifdef __CUDACC__
#define PKV_HOST_DEVICE __host__ __device__
#else
#define PKV_HOST_DEVICE
#endif

// Partial-state workspace: m [slots*G] | l [slots*G] | acc [slots*G*D], acc from a
// 16-byte boundary (float4 loads), so slots * G * (D + 2) + 4 floats always suffice.
inline PKV_HOST_DEVICE int64_t acc_offset(int64_t num_slots, int64_t G) { return (2 * num_slots * G + 3) / 4 * 4; }

struct DecodeParams {
  const void* q;            // [B, Hq, D]
  void* out;                // [B, Hq, D] (or the compact bucket rows when qo_indexed == 0)
  const void* kv;           // [num_pages, 2, Hkv, P, D]
  const int* block_table;   // [R, bt_stride] physical page ids, indexed by request id
  int64_t bt_stride;
  const int* seq_lens;      // [B] by batch row
  const int* req_ids;       // [B] batch row -> block-table row
  const int* rows;          // grid: [num_rows] launch row -> batch row; null in queue mode
  const int* tasks;         // queue: [num_tasks, 5] (row, kv_head, split, t_begin, t_end); null in grid mode
  const int* seg_offsets;   // fused only: slot range of segment (launch row, kv head)
  float* partial;           // m [slots*G] | l [slots*G] | acc [slots*G*D] (acc 16-byte aligned, see .cu)
  int* counters;            // fused only: one per segment, zero between launches
  int num_rows;             // grid rows (launch rows) or, in queue mode, batch rows
  int splits;               // grid only
  int num_slots;            // CTAs of this launch = partial-state slots
  int bound_len;            // grid: > 0 means split bounds from this length (row-local off)
  int num_kv_heads;
  int group;                // query heads per KV head, 1..8
  int page_shift;           // log2(page size)
  int qo_indexed;           // grid: q/out row = rows[i] (1) or i (0)
  int early_exit;           // empty splits return before loading Q
  OutMode mode;
  float scale_log2;         // log2(e) / sqrt(D)
};

struct MergeParams {
  const float* partial;
  const int* seg_offsets;   // [num_rows * Hkv + 1]
  const int* rows;          // launch row -> out row when qo_indexed; else i
  void* out;
  int num_rows;
  int num_kv_heads;
  int group;
  int num_slots;
  int qo_indexed;
};

// Both return the launch's cudaError_t (cudaGetLastError after the launch).
cudaError_t launch_decode(const DecodeParams& p, DType dtype, int head_dim, cudaStream_t stream);
cudaError_t launch_merge(const MergeParams& p, DType dtype, int head_dim, cudaStream_t stream);

}  // namespace pkv
