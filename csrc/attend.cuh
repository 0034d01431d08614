// Attention of one CTA over one token range of one (row, KV head): the inner loop both
// decode kernels share.
//
// The CTA's 4 warps take 16-token chunks of the range round-robin; each warp runs its own
// cp.async pipeline (kStages chunks deep, XOR-swizzled shared memory) and FA2-style
// tensor-core math: the G query heads of the KV head are the M rows of mma.m16n8k16
// (kRows = 1: G <= 8 in rows 0..7; kRows = 2: G <= 16), S = Q K^T with K by ldmatrix, the
// S accumulators reused as the A operand of P V, V by ldmatrix.trans. Softmax state is
// FP32 in the log2 domain. At the end the warps' states merge in shared memory and
// emit(e, h, acc[e], acc[e+1], m, l) receives the CTA's state, two elements at a time.
#pragma once

#include "ptx.cuh"
#include "state.cuh"

namespace pkv {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 16;  // tokens per warp step (the mma K of P V)
constexpr int kTile = 32;   // TILE_TOKENS of pkv.schedule: split bounds are in these tiles
constexpr int kMaxGroup = 16;  // query heads per KV head: the 16 M rows of the MMA

template <int D> struct AttendCfg {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  static constexpr int kRowBytes = D * 2;             // one token of K (or V)
  static constexpr int kPieces = D / 8;               // 16-byte pieces per token row
  static constexpr int kHalfBytes = kChunk * kRowBytes;
  static constexpr int kStageBytes = 2 * kHalfBytes;  // K then V
  static constexpr int kStages = 3;
  static constexpr int kSmem = kWarps * kStages * kStageBytes;  // 48 / 96 / 192 KB
  static constexpr int kCtasPerSm = D == 64 ? 3 : D == 128 ? 2 : 1;
  // At D = 256 the Q fragments would not fit in registers beside the accumulators: Q
  // (<= 8 heads there) waits in shared memory past the pipeline buffers instead.
  static constexpr bool kQInSmem = D > 128;
  static constexpr int kSmemTotal = kSmem + (kQInSmem ? 8 * D * 2 : 0);
  // The warps' states (m[16], l[16], acc[16][D] each) reuse the idle pipeline buffers.
  static_assert(kWarps * 16 * (D + 2) * 4 <= kSmem, "warp states must fit in the pipeline buffers");
  // Byte offset of (token, piece) inside a K or V chunk: XOR swizzle over 8 rows so
  // ldmatrix's 8 row addresses hit 8 different bank groups.
  static __device__ __forceinline__ int offset(int tok, int piece) {
    return tok * kRowBytes + ((piece ^ (tok & 7)) << 4);
  }
};

// One token range of one (row, KV head).
struct Range {
  const void* kv;          // [pages, 2, Hkv, P, D]
  const int* bt;           // the row's block-table row
  const void* q;           // the G query heads of this KV head: [G, D]
  int64_t head_off;        // kv_head * P * D
  int64_t page_elems;      // 2 * Hkv * P * D
  int64_t v_off;           // Hkv * P * D
  int page_shift;
  int t_begin, t_end;      // tokens read; zero-filled past t_end
  int valid_end;           // tokens at or past it are read and masked
  int group;
  float scale_log2;
};

template <typename T, int D, int kRows, class Emit>
__device__ __forceinline__ void attend_range(const Range& a, unsigned char* smem, Emit&& emit) {
  using C = AttendCfg<D>;
  constexpr int kAcc = 2 * kRows;  // accumulator floats per lane per 8-column block
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int G = a.group;
  const int P = 1 << a.page_shift;
  const T* kv = reinterpret_cast<const T*>(a.kv);
  const int chunks = (a.t_end - a.t_begin + kChunk - 1) / kChunk;
  const int my_chunks = chunks > warp ? (chunks - warp + kWarps - 1) / kWarps : 0;
  const uint32_t wbase_s = smem_addr(smem + warp * C::kStages * C::kStageBytes);

  // Pages of >= 16 tokens hold a whole (16-aligned) chunk: one block-table lookup per
  // chunk, loaded an iteration ahead of its use so its latency hides behind the math.
  auto chunk_page = [&](int j) {
    return P >= kChunk && j < my_chunks ? __ldg(a.bt + ((a.t_begin + (warp + j * kWarps) * kChunk) >> a.page_shift))
                                        : 0;
  };
  auto issue = [&](int j, int page0) {
    if (j < my_chunks) {
      const int tok0 = a.t_begin + (warp + j * kWarps) * kChunk;
      const uint32_t stage = wbase_s + (j % C::kStages) * C::kStageBytes;
#pragma unroll
      for (int it = 0; it < kChunk * C::kPieces / 32; ++it) {
        const int idx = it * 32 + lane;
        const int tok = idx / C::kPieces, piece = idx % C::kPieces;
        const int t = tok0 + tok;
        const bool ok = t < a.t_end;
        const int page = P >= kChunk ? page0 : (ok ? __ldg(a.bt + (t >> a.page_shift)) : 0);
        const T* src = kv + page * a.page_elems + a.head_off + (t & (P - 1)) * D + piece * 8;
        const uint32_t dst = stage + C::offset(tok, piece);
        cp_async16(dst, ok ? src : kv, ok ? 16 : 0);
        cp_async16(dst + C::kHalfBytes, ok ? src + a.v_off : kv, ok ? 16 : 0);
      }
    }
    cp_async_commit();  // empty groups keep the wait count uniform
  };

  float o[D / 8][kAcc];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < kAcc; ++e) o[j][e] = 0.f;
  float m_run[kRows], l_run[kRows];
#pragma unroll
  for (int rh = 0; rh < kRows; ++rh) m_run[rh] = -INFINITY, l_run[rh] = 0.f;

#pragma unroll
  for (int j = 0; j < C::kStages - 1; ++j) issue(j, chunk_page(j));

  // Q as A fragments (register khalf * kRows + rh holds row gid + 8 rh, columns
  // 16k + 8 khalf + 2 t4 ..+1; zero past G), loaded after the first KV copies are in
  // flight so the two latencies overlap.
  const T* qsrc = reinterpret_cast<const T*>(a.q);
  if constexpr (C::kQInSmem) {
    T* qs = reinterpret_cast<T*>(smem + C::kSmem);
    for (int i = threadIdx.x; i < G * D / 8; i += kThreads)
      reinterpret_cast<uint4*>(qs)[i] = reinterpret_cast<const uint4*>(qsrc)[i];
    __syncthreads();
    qsrc = qs;
  }
  auto q_frag = [&](int k, uint32_t (&f)[kAcc]) {
#pragma unroll
    for (int kh = 0; kh < 2; ++kh)
#pragma unroll
      for (int rh = 0; rh < kRows; ++rh) {
        const int row = gid + 8 * rh;
        f[kh * kRows + rh] =
            row < G ? *reinterpret_cast<const uint32_t*>(qsrc + row * D + 16 * k + 8 * kh + 2 * t4) : 0u;
      }
  };
  uint32_t qa[C::kQInSmem ? 1 : D / 16][kAcc];
  if constexpr (!C::kQInSmem) {
#pragma unroll
    for (int k = 0; k < D / 16; ++k) q_frag(k, qa[k]);
  }

  for (int j = 0; j < my_chunks; ++j) {
    const int next_page = chunk_page(j + C::kStages - 1);
    cp_async_wait<C::kStages - 2>();
    __syncwarp();
    const uint32_t k_s = wbase_s + (j % C::kStages) * C::kStageBytes;
    const uint32_t v_s = k_s + C::kHalfBytes;

    float s[2][kAcc];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < kAcc; ++e) s[n][e] = 0.f;
    {
      const int tok = (lane & 7) + ((lane >> 4) << 3), hi = (lane >> 3) & 1;
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        uint32_t b[4];
        ldsm_x4(k_s + C::offset(tok, 2 * k + hi), b);
        if constexpr (C::kQInSmem) q_frag(k, qa[0]);
        const auto& qk = qa[C::kQInSmem ? 0 : k];
        Mma<T>::run(s[0], qk, b[0], b[1]);
        Mma<T>::run(s[1], qk, b[2], b[3]);
      }
    }
    const int tok0 = a.t_begin + (warp + j * kWarps) * kChunk;
    uint32_t pa[kAcc];
#pragma unroll
    for (int rh = 0; rh < kRows; ++rh) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = tok0 + n * 8 + 2 * t4 + e;
          float& x = s[n][2 * rh + e];
          x = t < a.valid_end ? x * a.scale_log2 : -INFINITY;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[rh], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a fully masked prefix stays neutral
      const float alpha = exp2f(m_run[rh] - m_use);
      m_run[rh] = m_new;
      float psum = 0.f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float p0 = exp2f(s[n][2 * rh] - m_use), p1 = exp2f(s[n][2 * rh + 1] - m_use);
        psum += p0 + p1;
        pa[n * kRows + rh] = Mma<T>::pack(p0, p1);
      }
      l_run[rh] = l_run[rh] * alpha + psum;
#pragma unroll
      for (int jd = 0; jd < D / 8; ++jd) {
        o[jd][2 * rh] *= alpha;
        o[jd][2 * rh + 1] *= alpha;
      }
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
#pragma unroll
  for (int rh = 0; rh < kRows; ++rh) {
    l_run[rh] += __shfl_xor_sync(0xffffffffu, l_run[rh], 1);
    l_run[rh] += __shfl_xor_sync(0xffffffffu, l_run[rh], 2);
  }

  // CTA merge of the warps' states through the (now idle) pipeline buffers.
  __syncthreads();
  float* sm_m = reinterpret_cast<float*>(smem);
  float* sm_l = sm_m + kWarps * 16;
  float* sm_acc = sm_l + kWarps * 16;
#pragma unroll
  for (int rh = 0; rh < kRows; ++rh) {
    const int row = gid + 8 * rh;
    if (row < G) {
      if (t4 == 0) {
        sm_m[warp * 16 + row] = m_run[rh];
        sm_l[warp * 16 + row] = l_run[rh];
      }
#pragma unroll
      for (int jd = 0; jd < D / 8; ++jd)
        *reinterpret_cast<float2*>(sm_acc + (warp * 16 + row) * D + jd * 8 + 2 * t4) =
            make_float2(o[jd][2 * rh], o[jd][2 * rh + 1]);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x * 2; e < G * D; e += kThreads * 2) {
    const int h = e / D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w * 16 + h]);
    float den = 0.f, a0 = 0.f, a1 = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = rescale(sm_m[w * 16 + h], mx);
      den += wt * sm_l[w * 16 + h];
      const float2 v = *reinterpret_cast<const float2*>(sm_acc + w * 16 * D + e);
      a0 += wt * v.x;
      a1 += wt * v.y;
    }
    emit(e, h, a0, a1, mx, den);
  }
  __syncthreads();  // the buffers are free again for the caller
}

}  // namespace pkv
