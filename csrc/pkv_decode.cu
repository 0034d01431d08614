// PersistentKV's host-planned split decode (the workqueue and bucket launches), segmented merge
// and the fused and cluster-merge variants (paper §3.2–3.4). One CTA = one task (launch row, kv
// head, token range); the attention over the range is attend.cuh's, shared with the graph decode.
#include "pkv_decode.h"

#include "attend.cuh"

namespace pkv {
namespace {

constexpr int kMaxSegSlots = 256;  // slots per (row, kv head); the engine enforces splits <= this
constexpr int kMergeThreads = 256;

// Cluster mode: the CTA's merged state (m[8], l[8], acc[G*D]) past the warps' states.
template <int D> constexpr int kClusterStateOffset = kWarps * 16 * (D + 2) * 4;
static_assert(kClusterStateOffset<64> + (16 + 8 * 64) * 4 <= AttendCfg<64>::kSmem, "cluster state fits");
static_assert(kClusterStateOffset<128> + (16 + 8 * 128) * 4 <= AttendCfg<128>::kSmem, "cluster state fits");

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, AttendCfg<D>::kCtasPerSm) decode_kernel(const DecodeParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_last;

  // Let a programmatic dependent (the merge) launch once every CTA has started; it
  // still waits for this grid's completion before reading anything.
  griddep_launch_dependents();
  const int H = p.num_kv_heads, G = p.group, Hq = H * G;
  const int slot = blockIdx.x;

  // Which task: queue mode reads it, grid mode derives it (pkv.schedule.split_bounds).
  int row, kvh, t_begin, t_end, seg, qo_row;
  if (p.tasks != nullptr) {
    const int* t = p.tasks + 5 * slot;
    row = t[0]; kvh = t[1]; t_begin = t[3]; t_end = t[4];
    seg = row * H + kvh;
    qo_row = row;
  } else {
    const int split = slot % p.splits;
    seg = slot / p.splits;
    kvh = seg % H;
    const int i = seg / H;
    row = p.rows[i];
    qo_row = p.qo_indexed ? row : i;
    const int bound = p.bound_len > 0 ? p.bound_len : p.seq_lens[row];
    const int tiles = (bound + kTile - 1) / kTile;
    const int per_split = (tiles + p.splits - 1) / p.splits;
    t_begin = min(split * per_split * kTile, bound);
    t_end = min((split + 1) * per_split * kTile, bound);
  }
  const int G_D = G * D;
  float* part_m = p.partial;
  float* part_l = p.partial + static_cast<int64_t>(p.num_slots) * G;
  float* part_acc = p.partial + acc_offset(p.num_slots, G);

  float* st_m = reinterpret_cast<float*>(smem + kClusterStateOffset<D>);  // cluster mode only
  float* st_l = st_m + 8;
  float* st_acc = st_m + 16;
  T* out = reinterpret_cast<T*>(p.out) + (static_cast<int64_t>(qo_row) * Hq + kvh * G) * D;

  // Where this CTA's state goes: normalized output, shared memory (cluster), or its slot.
  auto emit = [&](int e, int h, float a0, float a1, float mx, float den) {
    if (p.mode == OutMode::kDirect) {
      Mma<T>::store2(out + e, a0 / den, a1 / den);
    } else if (p.mode == OutMode::kCluster) {
      *reinterpret_cast<float2*>(st_acc + e) = make_float2(a0, a1);
      if (e % D == 0) st_m[h] = mx, st_l[h] = den;
    } else {
      *reinterpret_cast<float2*>(part_acc + static_cast<int64_t>(slot) * G_D + e) = make_float2(a0, a1);
      if (e % D == 0) part_m[slot * G + h] = mx, part_l[slot * G + h] = den;
    }
  };

  if (t_begin >= t_end && p.early_exit) {
    // Zero-tile early exit: neutral state, no Q load, no pipeline staging. (A direct
    // launch has no empty task: every row holds >= 1 token.)
    if (p.mode != OutMode::kDirect)
      for (int e = threadIdx.x * 2; e < G_D; e += kThreads * 2) emit(e, e / D, 0.f, 0.f, -INFINITY, 0.f);
  } else {
    Range a;
    a.kv = p.kv;
    a.bt = p.block_table + static_cast<int64_t>(p.req_ids[row]) * p.bt_stride;
    a.q = reinterpret_cast<const T*>(p.q) + (static_cast<int64_t>(qo_row) * Hq + kvh * G) * D;
    const int P = 1 << p.page_shift;
    a.head_off = static_cast<int64_t>(kvh) * P * D;
    a.v_off = static_cast<int64_t>(H) * P * D;
    a.page_elems = 2 * a.v_off;
    a.tok_stride = D;
    a.page_shift = p.page_shift;
    a.t_begin = t_begin;
    a.t_end = t_end;
    a.valid_end = min(t_end, p.seq_lens[row]);  // later tokens are read and masked
    a.group = G;
    a.scale_log2 = p.scale_log2;
    attend_range<T, D, 1>(a, smem, emit);
  }

  if (p.mode == OutMode::kCluster) {
    // Cluster rank r (= the split) merges elements [r*per, (r+1)*per) of the segment's
    // G x D output from all ranks' shared memory; 4 threads share one element's ranks.
    cluster_sync();
    const int S = p.splits, rank = cluster_rank();
    const int per = (G_D + S - 1) / S, e_begin = rank * per, e_end = min(e_begin + per, G_D);
    const int sub = threadIdx.x & 3;
    for (int e0 = e_begin; e0 < e_end; e0 += kThreads / 4) {
      const int e = e0 + (threadIdx.x >> 2);
      const bool active = e < e_end;
      const int h = active ? e / D : 0;
      float mx = -INFINITY;
#pragma unroll 4
      for (int r = sub; r < S; r += 4) mx = fmaxf(mx, active ? ld_cluster(st_m + h, r) : -INFINITY);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      float den = 0.f, acc = 0.f;
      if (active)
#pragma unroll 4
        for (int r = sub; r < S; r += 4) {
          const float w = rescale(ld_cluster(st_m + h, r), mx);
          den += w * ld_cluster(st_l + h, r);
          acc += w * ld_cluster(st_acc + e, r);
        }
      den += __shfl_xor_sync(0xffffffffu, den, 1);
      den += __shfl_xor_sync(0xffffffffu, den, 2);
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      acc += __shfl_xor_sync(0xffffffffu, acc, 2);
      if (active && sub == 0) out[e] = Mma<T>::from_float(acc / den);
    }
    cluster_sync();  // keep this CTA's shared memory alive until every rank has read it
  }

  if (p.mode == OutMode::kFused) {
    // Last CTA of the segment merges; it also rearms the counter for the next launch
    // (and for CUDA-graph replay).
    __threadfence();
    __syncthreads();
    const int lo = p.seg_offsets[seg], hi = p.seg_offsets[seg + 1];
    if (threadIdx.x == 0) s_last = atomicAdd(p.counters + seg, 1) == hi - lo - 1;
    __syncthreads();
    if (s_last) {
      __threadfence();
      // The pipeline buffers are idle now: weights, then the cross-thread reduction.
      float* s_w = reinterpret_cast<float*>(smem);
      merge_states<T, D, true>(p.partial, p.num_slots, G, hi - lo, [=](int i) { return lo + i; }, out, s_w,
                               2 * kMaxSegSlots * 8, reinterpret_cast<float4*>(s_w + 2 * kMaxSegSlots * 8));
      if (threadIdx.x == 0) p.counters[seg] = 0;
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const MergeParams p) {
  // Launched as a programmatic dependent of the decode grid: wait until its partial
  // states are complete and visible (the launch itself overlapped the decode's tail).
  griddep_wait();
  const int seg = blockIdx.x;
  const int i = seg / p.num_kv_heads, kvh = seg % p.num_kv_heads;
  const int out_row = p.qo_indexed ? p.rows[i] : i;
  const int Hq = p.num_kv_heads * p.group;
  T* out = reinterpret_cast<T*>(p.out) + (static_cast<int64_t>(out_row) * Hq + kvh * p.group) * D;
  __shared__ float s_w[2 * kMaxSegSlots * 8];
  __shared__ float4 s_red[kMergeThreads];
  const int lo = p.seg_offsets[seg];
  merge_states<T, D, false>(p.partial, p.num_slots, p.group, p.seg_offsets[seg + 1] - lo,
                            [=](int i) { return lo + i; }, out, s_w, 2 * kMaxSegSlots * 8, s_red);
}

template <typename T, int D>
cudaError_t decode_typed(const DecodeParams& p, cudaStream_t stream) {
  static const cudaError_t attr =
      cudaFuncSetAttribute(decode_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, AttendCfg<D>::kSmem);
  if (attr != cudaSuccess) return attr;
  if (p.mode != OutMode::kCluster) {
    decode_kernel<T, D><<<p.num_slots, kThreads, AttendCfg<D>::kSmem, stream>>>(p);
    return cudaGetLastError();
  }
  static const cudaError_t cluster_attr =
      cudaFuncSetAttribute(decode_kernel<T, D>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (cluster_attr != cudaSuccess) return cluster_attr;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.num_slots);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = AttendCfg<D>::kSmem;
  cfg.stream = stream;
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = p.splits;
  cluster[0].val.clusterDim.y = 1;
  cluster[0].val.clusterDim.z = 1;
  cfg.attrs = cluster;
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, decode_kernel<T, D>, p);
  return err != cudaSuccess ? err : cudaGetLastError();
}

template <typename T, int D>
cudaError_t merge_typed(const MergeParams& p, cudaStream_t stream) {
  return launch_programmatic(merge_kernel<T, D>, dim3(p.num_rows * p.num_kv_heads), dim3(kMergeThreads), 0, stream, p);
}

}  // namespace

cudaError_t launch_decode(const DecodeParams& p, DType dtype, int head_dim, cudaStream_t stream) {
  if (p.group < 1 || p.group > 8 || p.num_slots < 1) return cudaErrorInvalidValue;
  if (p.mode == OutMode::kCluster && (p.tasks != nullptr || p.splits > kMaxClusterSplits || p.num_slots % p.splits))
    return cudaErrorInvalidValue;
  if (dtype == DType::kFloat16) {
    if (head_dim == 128) return decode_typed<__half, 128>(p, stream);
    if (head_dim == 64) return decode_typed<__half, 64>(p, stream);
  } else {
    if (head_dim == 128) return decode_typed<__nv_bfloat16, 128>(p, stream);
    if (head_dim == 64) return decode_typed<__nv_bfloat16, 64>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_merge(const MergeParams& p, DType dtype, int head_dim, cudaStream_t stream) {
  if (p.group < 1 || p.group > 8 || p.num_rows < 1) return cudaErrorInvalidValue;
  if (dtype == DType::kFloat16) {
    if (head_dim == 128) return merge_typed<__half, 128>(p, stream);
    if (head_dim == 64) return merge_typed<__half, 64>(p, stream);
  } else {
    if (head_dim == 128) return merge_typed<__nv_bfloat16, 128>(p, stream);
    if (head_dim == 64) return merge_typed<__nv_bfloat16, 64>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pkv
