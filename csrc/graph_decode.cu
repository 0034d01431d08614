// PersistentKV v4 decode: device-decided splits, one launch, last-CTA merge (graph_decode.h).
#include "graph_decode.h"

#include "attend_fp8.cuh"

namespace pkv {
namespace {

template <typename T, int D, int kRows, bool kFp8>
__global__ void __launch_bounds__(kThreads, AttendCfg<D, kFp8>::kCtasPerSm) graph_decode_kernel(const GraphDecodeParams p) {
  using C = AttendCfg<D, kFp8>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_inc[kGraphMaxRows];  // inclusive prefix sum of tiles over rows
  __shared__ int s_len[kGraphMaxRows];
  __shared__ int s_req[kGraphMaxRows];  // loaded with the lengths: one dependent load less per piece
  __shared__ int s_warp[kWarps];
  __shared__ int s_nzw[kWarps];
  __shared__ int s_last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int R = p.num_rows, H = p.num_kv_heads, G = p.group, Hq = H * G;

  // 1. The step's work: tiles per row, scanned (each thread owns kPer consecutive rows).
  constexpr int kPer = kGraphMaxRows / kThreads;
  int len[kPer], req[kPer], inc[kPer], run = 0, nz = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int r = tid * kPer + i;
    len[i] = r < R ? __ldg(p.seq_lens + r) : 0;
    req[i] = r < R ? __ldg(p.req_ids + r) : 0;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    run += (len[i] + kTile - 1) / kTile;
    nz += len[i] > 0;
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
  int before = x - run, total = 0, s_nz = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    before += w < warp ? s_warp[w] : 0;
    total += s_warp[w];
    s_nz += s_nzw[w];
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    s_inc[tid * kPer + i] = before + inc[i];
    s_len[tid * kPer + i] = len[i];
    s_req[tid * kPer + i] = req[i];
  }
  __syncthreads();

  // 2. This CTA's range of work units (unit = one tile of one KV head; segment (r, h)
  //    holds units [H*exc_r + h*tiles_r, +tiles_r)). Balanced to one tile.
  const int64_t W = static_cast<int64_t>(total) * H;
  // CTAs: at most the grid, no range under min_tiles; with fewer segments than CTAs, a
  // multiple of the segment count (so CTA ranges cut segments alike and no CTA straddles two).
  const int64_t want = (W + p.min_tiles - 1) / p.min_tiles;
  int n = static_cast<int>(want < p.num_ctas ? want : p.num_ctas);
  const int segments = s_nz * H;
  if (segments > 0 && segments <= n) n = n / segments * segments;
  const int j = blockIdx.x;
  if (j >= n) return;
  const int64_t lo = j * W / n, hi = (j + 1) * W / n;
  auto cta_of = [&](int64_t u) { return static_cast<int>(((u + 1) * n - 1) / W); };  // CTA whose range holds u

  int r = 0;
  {
    int r1 = R - 1;  // first row whose units end past lo
    while (r < r1) {
      const int mid = (r + r1) >> 1;
      if (static_cast<int64_t>(H) * s_inc[mid] > lo) r1 = mid; else r = mid + 1;
    }
  }
  const int num_slots = 2 * p.num_ctas;
  float* part_m = p.partial;
  float* part_l = p.partial + static_cast<int64_t>(num_slots) * G;
  float* part_acc = p.partial + acc_offset(num_slots, G);

  for (int64_t u = lo; u < hi;) {
    while (static_cast<int64_t>(H) * s_inc[r] <= u) ++r;
    const int exc = r ? s_inc[r - 1] : 0, tiles = s_inc[r] - exc;
    const int64_t row_base = static_cast<int64_t>(H) * exc;
    const int h = static_cast<int>((u - row_base) / tiles);
    const int64_t seg_begin = row_base + static_cast<int64_t>(h) * tiles, seg_end = seg_begin + tiles;
    const int64_t piece_end = hi < seg_end ? hi : seg_end;
    const int j0 = cta_of(seg_begin), j1 = cta_of(seg_end - 1);
    // A segment's first CTA stores its piece in slot 2j0 when its range starts there,
    // else 2j0 + 1 (its last piece); every later CTA's piece starts its range: slot 2j.
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
    a.t_begin = static_cast<int>(u - seg_begin) * kTile;
    a.t_end = min(static_cast<int>(piece_end - seg_begin) * kTile, s_len[r]);
    a.valid_end = a.t_end;
    a.group = G;
    a.scale_log2 = p.scale_log2 * p.k_scale;
    a.page_scales = p.page_scales;
    a.scale_head = h;
    a.num_kv_heads = H;
    a.out_scale = p.v_scale;

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
    } else {
      attend([&](int e, int hh, float a0, float a1, float mx, float den) {
        *reinterpret_cast<float2*>(part_acc + static_cast<int64_t>(slot) * G * D + e) = make_float2(a0, a1);
        if (e % D == 0) {
          part_m[slot * G + hh] = mx;
          part_l[slot * G + hh] = den;
        }
      });
      // Publish the state, then count in; the last of the segment's CTAs merges. (The
      // barrier orders every thread's stores before thread 0's fence: CUTLASS's semaphore.)
      __syncthreads();
      int* counter = p.counters + r * H + h;
      if (tid == 0) {
        __threadfence();
        s_last = atomicAdd(counter, 1) == j1 - j0;
      }
      __syncthreads();
      if (s_last) {
        __threadfence();
        const int first = j0 * W / n == seg_begin ? 2 * j0 : 2 * j0 + 1;
        constexpr int kRedBytes = kThreads * 16;  // s_red at the end of the idle pipeline buffers
        merge_states<T, D, true>(p.partial, num_slots, G, j1 - j0 + 1,
                                 [=](int i) { return i == 0 ? first : 2 * (j0 + i); }, out,
                                 reinterpret_cast<float*>(smem), (C::kSmem - kRedBytes) / 4,
                                 reinterpret_cast<float4*>(smem + (C::kSmem - kRedBytes)),
                                 p.lse != nullptr ? p.lse + qo / D : nullptr);
        if (tid == 0) *counter = 0;  // rearmed for the next launch (and graph replay)
      }
      __syncthreads();
    }
    u = piece_end;
  }
}

template <typename T, int D, int kRows, bool kFp8>
cudaError_t launch_typed(const GraphDecodeParams& p, cudaStream_t stream) {
  auto kernel = graph_decode_kernel<T, D, kRows, kFp8>;
  constexpr int smem = AttendCfg<D, kFp8>::kSmemTotal;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  kernel<<<p.num_ctas, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
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
      p.min_tiles < 1 || (p.page_scales != nullptr && (!kv_fp8 || (1 << p.page_shift) < kChunk)))
    return cudaErrorInvalidValue;
  return dtype == DType::kFloat16 ? launch_dim<__half>(p, kv_fp8, head_dim, stream)
                                  : launch_dim<__nv_bfloat16>(p, kv_fp8, head_dim, stream);
}

}  // namespace pkv
