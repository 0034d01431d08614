// PersistentKV split decode, segmented merge and fused-merge variant (paper §3.2–3.4).
//
// One CTA = one task (launch row, kv head, token range). Its 4 warps take 16-token chunks
// of the range round-robin; each warp runs its own cp.async pipeline (STAGES chunks deep,
// XOR-swizzled shared memory) and FA2-style tensor-core math: the G query heads of the
// KV head are the M rows (padded to 16) of mma.m16n8k16, S = Q K^T with K by ldmatrix,
// the S accumulators reused as the A operand of P V, V by ldmatrix.trans. Softmax state
// is FP32 in the log2 domain. At the end the warps' states merge in shared memory.
#include "pkv_decode.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

namespace pkv {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 16;  // tokens per warp step (the mma K of P V)
constexpr int kTile = 32;   // TILE_TOKENS of pkv.schedule: split bounds are in these tiles

template <typename T> struct Mma;

template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[2], const uint32_t (&a)[2], uint32_t b0, uint32_t b1) {
    // A rows 8..15 (a1, a3) and C rows 8..15 are padding: zero in, discarded out.
    asm volatile(
        "{ .reg .f32 x2, x3;\n"
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,x2,x3}, {%2,%3,%4,%3}, {%5,%6}, {%0,%1,%7,%7};\n}\n"
        : "+f"(d[0]), "+f"(d[1])
        : "r"(a[0]), "r"(0u), "r"(a[1]), "r"(b0), "r"(b1), "f"(0.f));
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ void store2(__half* p, float x, float y) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
  }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[2], const uint32_t (&a)[2], uint32_t b0, uint32_t b1) {
    asm volatile(
        "{ .reg .f32 x2, x3;\n"
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,x2,x3}, {%2,%3,%4,%3}, {%5,%6}, {%0,%1,%7,%7};\n}\n"
        : "+f"(d[0]), "+f"(d[1])
        : "r"(a[0]), "r"(0u), "r"(a[1]), "r"(b0), "r"(b1), "f"(0.f));
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ void store2(__nv_bfloat16* p, float x, float y) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes == 0 zero-fills (tokens past the task's range), so
// shared memory never holds stale values that could turn 0 * x into NaN.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ int cluster_rank() {
  int r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Release/acquire cluster barrier: shared-memory writes before it are visible to every
// CTA of the cluster after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ float ld_cluster(const float* local, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

template <int D> struct Cfg {
  static constexpr int kRowBytes = D * 2;             // one token of K (or V)
  static constexpr int kPieces = D / 8;               // 16-byte pieces per token row
  static constexpr int kHalfBytes = kChunk * kRowBytes;
  static constexpr int kStageBytes = 2 * kHalfBytes;  // K then V
  static constexpr int kStages = D == 128 ? 3 : 4;    // two CTAs per SM at d=128, three at d=64
  static constexpr int kSmem = kWarps * kStages * kStageBytes;
  // Cluster mode: the CTA's merged state (m[8], l[8], acc[G*D]) past the warps' states.
  static constexpr int kStateOffset = 2 * kWarps * 8 * 4 + kWarps * 8 * D * 4;
  static_assert(kStateOffset + (16 + 8 * D) * 4 <= kSmem, "cluster state must fit in the pipeline buffers");
  // Byte offset of (token, piece) inside a K or V chunk: XOR swizzle over 8 rows so
  // ldmatrix's 8 row addresses hit 8 different bank groups.
  static __device__ __forceinline__ int offset(int tok, int piece) {
    return tok * kRowBytes + ((piece ^ (tok & 7)) << 4);
  }
};

// Partial-state layout: m [slots*G] | l [slots*G] | acc [slots*G*D] from a 16-byte boundary.
__host__ __device__ __forceinline__ int64_t acc_offset(int num_slots, int G) {
  return (2 * static_cast<int64_t>(num_slots) * G + 3) / 4 * 4;
}

constexpr int kMaxSegSlots = 256;  // slots per (row, kv head); the engine enforces splits <= this
constexpr int kMergeThreads = 256;

// Exact merge of the partial states [lo, hi) of one segment into its G output heads.
// Shared by the merge kernel and the last CTA of a segment in the fused variant (which
// reads with __ldcg: the slots were written by other SMs during the same launch).
// Weights exp2(m_s - m) / sum_s exp2(m_s - m) l_s are computed once in shared memory;
// then threads own float4 columns of acc and stream the slots with 8 loads in flight.
template <typename T, int D, bool kCoherent>
__device__ void merge_segment(const float* partial, int num_slots, int G, int lo, int hi, T* out_heads,
                              float* s_w /* kMaxSegSlots * 8 */, float4* s_red /* blockDim.x */) {
  const int n = hi - lo, tid = threadIdx.x, nt = blockDim.x;
  const float* m = partial + static_cast<int64_t>(lo) * G;
  const float* l = partial + static_cast<int64_t>(num_slots) * G + static_cast<int64_t>(lo) * G;
  const float4* acc = reinterpret_cast<const float4*>(partial + acc_offset(num_slots, G)) +
                      static_cast<int64_t>(lo) * G * (D / 4);
  auto ld = [](const float* q) { return kCoherent ? __ldcg(q) : __ldg(q); };
  __shared__ float s_max[8], s_inv[8];
  for (int i = tid; i < n * G; i += nt) s_w[i] = ld(m + i);
  __syncthreads();
  if (tid < G) {
    float mx = -INFINITY;
    for (int s = 0; s < n; ++s) mx = fmaxf(mx, s_w[s * G + tid]);
    float den = 0.f;
    for (int s = 0; s < n; ++s) {
      const float ms = s_w[s * G + tid];
      den += (ms == -INFINITY ? 0.f : exp2f(ms - mx)) * ld(l + s * G + tid);
    }
    s_max[tid] = mx;
    s_inv[tid] = 1.f / den;
  }
  __syncthreads();
  for (int i = tid; i < n * G; i += nt) {
    const float ms = s_w[i];
    s_w[i] = ms == -INFINITY ? 0.f : exp2f(ms - s_max[i % G]) * s_inv[i % G];
  }
  __syncthreads();

  const int cols = G * D / 4;                      // float4 columns of acc per slot
  const int lanes = cols >= nt ? 1 : nt / cols;    // threads splitting one column's slots
  for (int c0 = 0; c0 < cols; c0 += nt / lanes) {
    const int c = c0 + tid % (nt / lanes), r = tid / (nt / lanes);
    const int h = c / (D / 4);
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < cols && r < lanes) {
      for (int s0 = r; s0 < n; s0 += 8 * lanes) {
        float4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          // Clamped (weight 0 past n) rather than branched: all 8 loads issue back to back.
          const float4* src = acc + static_cast<int64_t>(min(s0 + u * lanes, n - 1)) * cols + c;
          v[u] = kCoherent ? __ldcg(src) : __ldg(src);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int s = s0 + u * lanes;
          const float w = s < n ? s_w[s * G + h] : 0.f;
          sum.x += w * v[u].x; sum.y += w * v[u].y; sum.z += w * v[u].z; sum.w += w * v[u].w;
        }
      }
    }
    if (lanes > 1) {
      s_red[tid] = sum;
      __syncthreads();
      if (r == 0 && c < cols)
        for (int k = 1; k < lanes; ++k) {
          const float4 o = s_red[k * (nt / lanes) + tid];
          sum.x += o.x; sum.y += o.y; sum.z += o.z; sum.w += o.w;
        }
      __syncthreads();
    }
    if (r == 0 && c < cols) {
      Mma<T>::store2(out_heads + 4 * c, sum.x, sum.y);
      Mma<T>::store2(out_heads + 4 * c + 2, sum.z, sum.w);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) decode_kernel(const DecodeParams p) {
  using C = Cfg<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_last;

  // Let a programmatic dependent (the merge) launch once every CTA has started; it
  // still waits for this grid's completion before reading anything.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
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

  float* st_m = reinterpret_cast<float*>(smem + C::kStateOffset);  // cluster mode only
  float* st_l = st_m + 8;
  float* st_acc = st_m + 16;

  if (t_begin >= t_end && p.early_exit) {
    // Zero-tile early exit: neutral state, no Q load, no pipeline staging. (In cluster
    // mode the neutral state goes to shared memory: the CTA still joins the cluster merge.)
    float* acc_dst = p.mode == OutMode::kCluster ? st_acc : part_acc + static_cast<int64_t>(slot) * G_D;
    float* m_dst = p.mode == OutMode::kCluster ? st_m : part_m + slot * G;
    float* l_dst = p.mode == OutMode::kCluster ? st_l : part_l + slot * G;
    for (int e = threadIdx.x; e < G_D; e += kThreads) acc_dst[e] = 0.f;
    if (threadIdx.x < G) {
      m_dst[threadIdx.x] = -INFINITY;
      l_dst[threadIdx.x] = 0.f;
    }
  } else {
    const int gid = lane >> 2, t4 = lane & 3;
    const int valid_end = min(t_end, p.seq_lens[row]);  // later tokens are read and masked

    const int P = 1 << p.page_shift;
    const int* bt = p.block_table + static_cast<int64_t>(p.req_ids[row]) * p.bt_stride;
    const T* kv = reinterpret_cast<const T*>(p.kv);
    const int64_t head_elems = static_cast<int64_t>(P) * D;          // one (page, k|v, head) block
    const int64_t page_elems = 2 * static_cast<int64_t>(H) * head_elems;
    const int64_t head_off = kvh * head_elems;
    const int64_t v_off = H * head_elems;

    const int chunks = (t_end - t_begin + kChunk - 1) / kChunk;
    const int my_chunks = chunks > warp ? (chunks - warp + kWarps - 1) / kWarps : 0;
    unsigned char* wbase = smem + warp * C::kStages * C::kStageBytes;
    const uint32_t wbase_s = smem_addr(wbase);

    // Pages of >= 16 tokens hold a whole (16-aligned) chunk: one block-table lookup per
    // chunk, loaded an iteration ahead of its use so its latency hides behind the math.
    auto chunk_page = [&](int j) {
      return P >= kChunk && j < my_chunks ? __ldg(bt + ((t_begin + (warp + j * kWarps) * kChunk) >> p.page_shift)) : 0;
    };
    auto issue = [&](int j, int page0) {
      if (j < my_chunks) {
        const int tok0 = t_begin + (warp + j * kWarps) * kChunk;
        const uint32_t stage = wbase_s + (j % C::kStages) * C::kStageBytes;
#pragma unroll
        for (int it = 0; it < kChunk * C::kPieces / 32; ++it) {
          const int idx = it * 32 + lane;
          const int tok = idx / C::kPieces, piece = idx % C::kPieces;
          const int t = tok0 + tok;
          const bool ok = t < t_end;
          const int page = P >= kChunk ? page0 : (ok ? __ldg(bt + (t >> p.page_shift)) : 0);
          const T* src = kv + page * page_elems + head_off + (t & (P - 1)) * D + piece * 8;
          const uint32_t dst = stage + C::offset(tok, piece);
          cp_async16(dst, ok ? src : kv, ok ? 16 : 0);
          cp_async16(dst + C::kHalfBytes, ok ? src + v_off : kv, ok ? 16 : 0);
        }
      }
      cp_async_commit();  // empty groups keep the wait count uniform
    };

    float o[D / 8][2];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = 0.f;
    float m_run = -INFINITY, l_run = 0.f;

#pragma unroll
    for (int j = 0; j < C::kStages - 1; ++j) issue(j, chunk_page(j));

    // Q as A fragments (row gid = query head gid of the group, zero past G), loaded
    // after the first KV copies are in flight so the two latencies overlap.
    uint32_t qa[D / 16][2];
    {
      const T* qh = reinterpret_cast<const T*>(p.q) + (static_cast<int64_t>(qo_row) * Hq + kvh * G + gid) * D;
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        qa[k][0] = gid < G ? *reinterpret_cast<const uint32_t*>(qh + 16 * k + 2 * t4) : 0u;
        qa[k][1] = gid < G ? *reinterpret_cast<const uint32_t*>(qh + 16 * k + 8 + 2 * t4) : 0u;
      }
    }

    for (int j = 0; j < my_chunks; ++j) {
      const int next_page = chunk_page(j + C::kStages - 1);
      cp_async_wait<C::kStages - 2>();
      __syncwarp();
      const uint32_t k_s = wbase_s + (j % C::kStages) * C::kStageBytes;
      const uint32_t v_s = k_s + C::kHalfBytes;

      float s[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
      {
        const int tok = (lane & 7) + ((lane >> 4) << 3), hi = (lane >> 3) & 1;
#pragma unroll
        for (int k = 0; k < D / 16; ++k) {
          uint32_t b[4];
          ldsm_x4(k_s + C::offset(tok, 2 * k + hi), b);
          Mma<T>::run(s[0], qa[k], b[0], b[1]);
          Mma<T>::run(s[1], qa[k], b[2], b[3]);
        }
      }
      const int tok0 = t_begin + (warp + j * kWarps) * kChunk;
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = tok0 + n * 8 + 2 * t4 + e;
          s[n][e] = t < valid_end ? s[n][e] * p.scale_log2 : -INFINITY;
          mx = fmaxf(mx, s[n][e]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run, mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a fully masked prefix stays neutral
      const float alpha = exp2f(m_run - m_use);
      m_run = m_new;
      uint32_t pa[2];
      float psum = 0.f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float p0 = exp2f(s[n][0] - m_use), p1 = exp2f(s[n][1] - m_use);
        psum += p0 + p1;
        pa[n] = Mma<T>::pack(p0, p1);
      }
      l_run = l_run * alpha + psum;
#pragma unroll
      for (int jd = 0; jd < D / 8; ++jd) {
        o[jd][0] *= alpha;
        o[jd][1] *= alpha;
      }
      {
        const int tok = (lane & 7) + (((lane >> 3) & 1) << 3), hi = lane >> 4;
#pragma unroll
        for (int jd = 0; jd < D / 16; ++jd) {
          uint32_t b[4];
          ldsm_x4_trans(v_s + C::offset(tok, 2 * jd + hi), b);
          Mma<T>::run(o[2 * jd], pa, b[0], b[1]);
          Mma<T>::run(o[2 * jd + 1], pa, b[2], b[3]);
        }
      }
      __syncwarp();  // every lane is done with this stage before it is refilled
      issue(j + C::kStages - 1, next_page);
    }
    cp_async_wait<0>();
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);

    // CTA merge of the warps' states through (now idle) pipeline shared memory.
    __syncthreads();
    float* sm_m = reinterpret_cast<float*>(smem);
    float* sm_l = sm_m + kWarps * 8;
    float* sm_acc = sm_l + kWarps * 8;
    if (gid < G) {
      if (t4 == 0) {
        sm_m[warp * 8 + gid] = m_run;
        sm_l[warp * 8 + gid] = l_run;
      }
#pragma unroll
      for (int jd = 0; jd < D / 8; ++jd)
        *reinterpret_cast<float2*>(sm_acc + (warp * 8 + gid) * D + jd * 8 + 2 * t4) = make_float2(o[jd][0], o[jd][1]);
    }
    __syncthreads();
    for (int e = threadIdx.x * 2; e < G_D; e += kThreads * 2) {
      const int h = e / D;
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w * 8 + h]);
      float den = 0.f, a0 = 0.f, a1 = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float mw = sm_m[w * 8 + h];
        const float wt = mw == -INFINITY ? 0.f : exp2f(mw - mx);
        den += wt * sm_l[w * 8 + h];
        const float2 a = *reinterpret_cast<const float2*>(sm_acc + w * 8 * D + e);
        a0 += wt * a.x;
        a1 += wt * a.y;
      }
      if (p.mode == OutMode::kDirect) {
        T* out = reinterpret_cast<T*>(p.out) + (static_cast<int64_t>(qo_row) * Hq + kvh * G) * D;
        Mma<T>::store2(out + e, a0 / den, a1 / den);
      } else if (p.mode == OutMode::kCluster) {
        *reinterpret_cast<float2*>(st_acc + e) = make_float2(a0, a1);
        if (e % D == 0) {
          st_m[h] = mx;
          st_l[h] = den;
        }
      } else {
        *reinterpret_cast<float2*>(part_acc + static_cast<int64_t>(slot) * G_D + e) = make_float2(a0, a1);
        if (e % D == 0) {
          part_m[slot * G + h] = mx;
          part_l[slot * G + h] = den;
        }
      }
    }
  }

  if (p.mode == OutMode::kCluster) {
    // Cluster rank r (= the split) merges elements [r*per, (r+1)*per) of the segment's
    // G x D output from all ranks' shared memory; 4 threads share one element's ranks.
    cluster_sync();
    const int S = p.splits, rank = cluster_rank();
    const int per = (G_D + S - 1) / S, e_begin = rank * per, e_end = min(e_begin + per, G_D);
    T* out = reinterpret_cast<T*>(p.out) + (static_cast<int64_t>(qo_row) * Hq + kvh * G) * D;
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
      float den = 0.f, a = 0.f;
      if (active)
#pragma unroll 4
        for (int r = sub; r < S; r += 4) {
          const float mr = ld_cluster(st_m + h, r);
          const float w = mr == -INFINITY ? 0.f : exp2f(mr - mx);
          den += w * ld_cluster(st_l + h, r);
          a += w * ld_cluster(st_acc + e, r);
        }
      den += __shfl_xor_sync(0xffffffffu, den, 1);
      den += __shfl_xor_sync(0xffffffffu, den, 2);
      a += __shfl_xor_sync(0xffffffffu, a, 1);
      a += __shfl_xor_sync(0xffffffffu, a, 2);
      if (active && sub == 0) out[e] = Mma<T>::from_float(a / den);
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
      T* out = reinterpret_cast<T*>(p.out) + (static_cast<int64_t>(qo_row) * Hq + kvh * G) * D;
      // The pipeline buffers are idle now: weights, then the cross-thread reduction.
      float* s_w = reinterpret_cast<float*>(smem);
      merge_segment<T, D, true>(p.partial, p.num_slots, G, lo, hi, out, s_w,
                                reinterpret_cast<float4*>(s_w + kMaxSegSlots * 8));
      if (threadIdx.x == 0) p.counters[seg] = 0;
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const MergeParams p) {
  // Launched as a programmatic dependent of the decode grid: wait until its partial
  // states are complete and visible (the launch itself overlapped the decode's tail).
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const int seg = blockIdx.x;
  const int i = seg / p.num_kv_heads, kvh = seg % p.num_kv_heads;
  const int out_row = p.qo_indexed ? p.rows[i] : i;
  const int Hq = p.num_kv_heads * p.group;
  T* out = reinterpret_cast<T*>(p.out) + (static_cast<int64_t>(out_row) * Hq + kvh * p.group) * D;
  __shared__ float s_w[kMaxSegSlots * 8];
  __shared__ float4 s_red[kMergeThreads];
  merge_segment<T, D, false>(p.partial, p.num_slots, p.group, p.seg_offsets[seg], p.seg_offsets[seg + 1], out, s_w,
                             s_red);
}

template <typename T, int D>
cudaError_t decode_typed(const DecodeParams& p, cudaStream_t stream) {
  static const cudaError_t attr =
      cudaFuncSetAttribute(decode_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg<D>::kSmem);
  if (attr != cudaSuccess) return attr;
  if (p.mode != OutMode::kCluster) {
    decode_kernel<T, D><<<p.num_slots, kThreads, Cfg<D>::kSmem, stream>>>(p);
    return cudaGetLastError();
  }
  static const cudaError_t cluster_attr =
      cudaFuncSetAttribute(decode_kernel<T, D>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (cluster_attr != cudaSuccess) return cluster_attr;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.num_slots);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = Cfg<D>::kSmem;
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
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.num_rows * p.num_kv_heads);
  cfg.blockDim = dim3(kMergeThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, merge_kernel<T, D>, p);
  return err != cudaSuccess ? err : cudaGetLastError();
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
