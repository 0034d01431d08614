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
//
// kFp8: K and V are FP8 e4m3 (one byte per element, half the bytes to stream) and the
// math is fp16 mma whatever the query type. Both stay in the byte layout they were copied
// in; ldmatrix reads them as b16 pairs and cvt.rn.f16x2.e4m3x2 widens each pair in
// registers, so no fp16 copy of the tile is written anywhere:
//  - K (B operand of S = Q K^T): ldmatrix hands lane (gid, t4) token gid, bytes 4t4..+3 of a
//    16-dim block. Taken as the fragment's k = 2t4, 2t4+1, 2t4+8, 2t4+9, this permutes
//    the reduction (head_dim) inside each block; Q's fragments are loaded with the same
//    permutation, so the dot products are unchanged.
//  - V (B operand of O = P V): ldmatrix.trans hands lane (gid, t4) tokens 2t4, 2t4+1 of
//    dims 2gid, 2gid+1; one byte_perm splits them into the even-dim and odd-dim
//    fragments, so accumulator block 2p + parity holds dims 16p + 4t4 + 2e + parity,
//    which the CTA merge writes back in natural order.
// Scales: dequantized x = e4m3 * tensor scale * (optional) per-(page, K/V, kv head)
// factor. The K scales multiply the scores (FP32); a page's V factor multiplies P before
// its fp16 pack (l sums P unscaled), the tensor V scale the CTA's output state.
#pragma once

#include <type_traits>

#include "ptx.cuh"
#include "state.cuh"

// Build-time knobs (PKV_NVCC_FLAGS in pkv/kernels.py), for measuring alternatives.
#ifndef PKV_FP8_SUB
#define PKV_FP8_SUB 2
#endif
#ifndef PKV_FP8_STAGES
#define PKV_FP8_STAGES (PKV_FP8_SUB == 1 ? 4 : 3)
#endif
#ifndef PKV_FP8_CTAS
#define PKV_FP8_CTAS 0
#endif
#ifndef PKV_FP8_ALU_WIDEN
#define PKV_FP8_ALU_WIDEN 0
#endif

namespace pkv {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 16;  // tokens per warp step (the mma K of P V)
constexpr int kTile = 32;   // TILE_TOKENS of pkv.schedule: split bounds are in these tiles
constexpr int kMaxGroup = 16;  // query heads per KV head: the 16 M rows of the MMA

template <int D, bool kFp8 = false> struct AttendCfg {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  static constexpr int kRowBytes = D * (kFp8 ? 1 : 2);  // one token of K (or V)
  static constexpr int kPieces = kRowBytes / 16;        // 16-byte pieces per token row
  // A warp step takes kSub 16-token sub-chunks: FP8 steps take two, so a step moves as
  // many bytes as a 16-bit one and the per-step softmax work is spread over twice the tokens.
  static constexpr int kSub = kFp8 ? PKV_FP8_SUB : 1;
  static constexpr int kStepTokens = kSub * kChunk;
  static constexpr int kHalfBytes = kStepTokens * kRowBytes;
  static constexpr int kStageBytes = 2 * kHalfBytes;    // K then V
  static constexpr int kStages = kFp8 ? PKV_FP8_STAGES : 3;
  static constexpr int kSmem = kWarps * kStages * kStageBytes;  // 48 / 96 / 192 KB (16-bit and FP8 alike)
  static constexpr int kCtasPerSm = kFp8 && PKV_FP8_CTAS ? PKV_FP8_CTAS : D == 64 ? 3 : D == 128 ? 2 : 1;
  // At D = 256 the Q fragments would not fit in registers beside the accumulators: Q
  // (<= 8 heads there) waits in shared memory past the pipeline buffers instead.
  static constexpr bool kQInSmem = D > 128;
  static constexpr int kQOffset = kSmem;
  // FP8 page scales (K, V factor of the chunk's page) land beside each stage, by cp.async.
  static constexpr int kScaleOffset = kQOffset + (kQInSmem ? 8 * D * 2 : 0);
  static constexpr int kSmemTotal = kScaleOffset + (kFp8 ? kWarps * kStages * kSub * 8 : 0);
  // The warps' states (m[16], l[16], acc[16][D] each) reuse the idle pipeline buffers.
  static_assert(kWarps * 16 * (D + 2) * 4 <= kSmem, "warp states must fit in the pipeline buffers");
  static_assert(kRowBytes == 64 || kRowBytes % 128 == 0, "rows of 64 bytes or whole 128-byte lines");
  // Byte offset of (token, piece) inside a K or V chunk: XOR swizzle so ldmatrix's 8 row
  // addresses (8 tokens, one piece) hit 8 different 16-byte bank groups. Rows of 64
  // bytes pair up in a 128-byte line: odd tokens take the line's other half.
  static __device__ __forceinline__ int offset(int tok, int piece) {
    const int swz = kRowBytes >= 128 ? tok & 7 : (tok >> 1) & 3;
    return tok * kRowBytes + ((piece ^ swz) << 4);
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
  float scale_log2;        // log2(e) / sqrt(D), times the K tensor scale (FP8)
  // FP8 only: per-(page, K/V, kv head) factors [pages, 2, Hkv] or null; this range's
  // K factor of page p is at p * 2 Hkv + kv_head, its V factor Hkv later.
  const float* page_scales;
  int scale_head, num_kv_heads;
  float out_scale;         // the V tensor scale: multiplies the CTA's output state
};

// With the ALU widening an e4m3 value arrives as fp16 times 2^-8 (kFp8Unit): its bits
// shifted into fp16's fields keep the 8 - 15 exponent-bias difference, subnormals too.
constexpr float kFp8Unit = PKV_FP8_ALU_WIDEN ? 256.f : 1.f;

// FP8 pair widening: the two e4m3 bytes of a 16-bit half of x to an f16x2 register.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x, bool hi) {
#if PKV_FP8_ALU_WIDEN
  const uint32_t w = __byte_perm(x, 0, hi ? 0x3424 : 0x1404);  // each byte to the top of its 16-bit half
  return (w & 0x80008000u) | ((w >> 1) & 0x3f803f80u);         // sign stays, exponent+mantissa down one bit
#else
  const unsigned short pair = static_cast<unsigned short>(hi ? x >> 16 : x & 0xffffu);
  uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(pair));
  return r;
#endif
}

// Two adjacent query elements as the math type's packed pair (bf16 queries against an
// FP8 cache run fp16 math: e4m3 values and P are exact or better in fp16).
template <typename M, typename T> __device__ __forceinline__ uint32_t q_pair(const T* p) {
  if constexpr (std::is_same_v<M, T>) {
    return *reinterpret_cast<const uint32_t*>(p);
  } else {
    const __half2 h = __float22half2_rn(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p)));
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

template <typename T, int D, int kRows, bool kFp8 = false, class Emit>
__device__ __forceinline__ void attend_range(const Range& a, unsigned char* smem, Emit&& emit) {
  using C = AttendCfg<D, kFp8>;
  using M = std::conditional_t<kFp8, __half, T>;           // mma operand type
  using KvT = std::conditional_t<kFp8, unsigned char, T>;  // one KV element
  constexpr int kPieceElems = 16 / sizeof(KvT);
  constexpr int kAcc = 2 * kRows;  // accumulator floats per lane per 8-column block
  constexpr int kSub = C::kSub, kStep = C::kStepTokens, kNB = kStep / 8;  // S has kNB 8-token blocks
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int G = a.group;
  const int P = 1 << a.page_shift;
  const KvT* kv = reinterpret_cast<const KvT*>(a.kv);
  const int chunks = (a.t_end - a.t_begin + kStep - 1) / kStep;
  const int my_chunks = chunks > warp ? (chunks - warp + kWarps - 1) / kWarps : 0;
  const uint32_t wbase_s = smem_addr(smem + warp * C::kStages * C::kStageBytes);
  float* const wscale = reinterpret_cast<float*>(smem + C::kScaleOffset) + warp * C::kStages * kSub * 2;

  // Pages of >= 16 tokens hold whole (16-aligned) sub-chunks: one block-table lookup per
  // sub-chunk, loaded an iteration ahead of its use so its latency hides behind the math.
  struct Pages { int id[kSub]; };
  auto chunk_pages = [&](int j) {
    Pages pg;
#pragma unroll
    for (int i = 0; i < kSub; ++i)
      pg.id[i] = P >= kChunk && j < my_chunks
                     ? __ldg(a.bt + ((a.t_begin + (warp + j * kWarps) * kStep + i * kChunk) >> a.page_shift)) : 0;
    return pg;
  };
  auto issue = [&](int j, const Pages& pg) {
    if (j < my_chunks) {
      const int tok0 = a.t_begin + (warp + j * kWarps) * kStep;
      const uint32_t stage = wbase_s + (j % C::kStages) * C::kStageBytes;
      static_assert(kChunk * C::kPieces % 32 == 0, "a sub-chunk is whole rounds of 32 lanes");
#pragma unroll
      for (int it = 0; it < kStep * C::kPieces / 32; ++it) {
        const int idx = it * 32 + lane;
        const int tok = idx / C::kPieces, piece = idx % C::kPieces;
        const int t = tok0 + tok;
        const bool ok = t < a.t_end;
        const int page = P >= kChunk ? pg.id[it * 32 / (kChunk * C::kPieces)]
                                     : (ok ? __ldg(a.bt + (t >> a.page_shift)) : 0);
        const KvT* src = kv + page * a.page_elems + a.head_off + (t & (P - 1)) * D + piece * kPieceElems;
        const uint32_t dst = stage + C::offset(tok, piece);
        cp_async16(dst, ok ? src : kv, ok ? 16 : 0);
        cp_async16(dst + C::kHalfBytes, ok ? src + a.v_off : kv, ok ? 16 : 0);
      }
      if constexpr (kFp8) {
        // The page's K and V factors travel with its bytes (pages >= one chunk: the host
        // refuses page factors on smaller pages).
        if (a.page_scales != nullptr && lane < kSub) {
          const float* f = a.page_scales + static_cast<int64_t>(pg.id[lane]) * 2 * a.num_kv_heads + a.scale_head;
          const uint32_t s_dst = smem_addr(wscale + ((j % C::kStages) * kSub + lane) * 2);
          cp_async4(s_dst, f);
          cp_async4(s_dst + 4, f + a.num_kv_heads);
        }
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
  for (int j = 0; j < C::kStages - 1; ++j) issue(j, chunk_pages(j));

  // Q as A fragments (register khalf * kRows + rh holds row gid + 8 rh, columns
  // 16k + 8 khalf + 2 t4 ..+1; zero past G), loaded after the first KV copies are in
  // flight so the two latencies overlap.
  const T* qsrc = reinterpret_cast<const T*>(a.q);
  if constexpr (C::kQInSmem) {
    T* qs = reinterpret_cast<T*>(smem + C::kQOffset);
    for (int i = threadIdx.x; i < G * D / 8; i += kThreads)
      reinterpret_cast<uint4*>(qs)[i] = reinterpret_cast<const uint4*>(qsrc)[i];
    __syncthreads();
    qsrc = qs;
  }
  // FP8: the fragment's k = 2t4 (+1), 2t4 + 8 (+1) are dims 4t4 (+1), 4t4 + 2 (+1) of the
  // block, the permutation the K bytes arrive in (see the top of this file).
  auto q_frag = [&](int k, uint32_t (&f)[kAcc]) {
#pragma unroll
    for (int kh = 0; kh < 2; ++kh)
#pragma unroll
      for (int rh = 0; rh < kRows; ++rh) {
        const int row = gid + 8 * rh;
        const int col = 16 * k + (kFp8 ? 4 * t4 + 2 * kh : 8 * kh + 2 * t4);
        f[kh * kRows + rh] = row < G ? q_pair<M>(qsrc + row * D + col) : 0u;
      }
  };
  // At D = 256 the fragments of the two k-steps in use are rebuilt from shared memory.
  uint32_t qa[C::kQInSmem ? 2 : D / 16][kAcc];
  auto q_at = [&](int k) -> const uint32_t(&)[kAcc] { return qa[C::kQInSmem ? (k & 1) : k]; };
  if constexpr (!C::kQInSmem) {
#pragma unroll
    for (int k = 0; k < D / 16; ++k) q_frag(k, qa[k]);
  }

  for (int j = 0; j < my_chunks; ++j) {
    const Pages next_pages = chunk_pages(j + C::kStages - 1);
    cp_async_wait<C::kStages - 2>();
    __syncwarp();
    const uint32_t k_s = wbase_s + (j % C::kStages) * C::kStageBytes;
    const uint32_t v_s = k_s + C::kHalfBytes;

    float s[kNB][kAcc];
#pragma unroll
    for (int n = 0; n < kNB; ++n)
#pragma unroll
      for (int e = 0; e < kAcc; ++e) s[n][e] = 0.f;
    if constexpr (kFp8) {
      // Matrices: tokens 0-7 / 8-15 of sub-chunk h, pieces k and k + 1 (a piece = one
      // 16-dim k-step); S blocks 2h, 2h + 1.
      const int tok = (lane & 7) + (((lane >> 3) & 1) << 3), hi = lane >> 4;
#pragma unroll
      for (int k = 0; k < D / 16; k += 2) {
        if constexpr (C::kQInSmem) q_frag(k, qa[0]), q_frag(k + 1, qa[1]);
#pragma unroll
        for (int h = 0; h < kSub; ++h) {
          uint32_t b[4];
          ldsm_x4(k_s + C::offset(kChunk * h + tok, k + hi), b);
#pragma unroll
          for (int i = 0; i < 4; ++i)
            Mma<M>::run(s[2 * h + (i & 1)], q_at(k + (i >> 1)), e4m3x2_to_f16x2(b[i], false),
                        e4m3x2_to_f16x2(b[i], true));
        }
      }
    } else {
      const int tok = (lane & 7) + ((lane >> 4) << 3), hi = (lane >> 3) & 1;
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        uint32_t b[4];
        ldsm_x4(k_s + C::offset(tok, 2 * k + hi), b);
        if constexpr (C::kQInSmem) q_frag(k, qa[k & 1]);
        Mma<T>::run(s[0], q_at(k), b[0], b[1]);
        Mma<T>::run(s[1], q_at(k), b[2], b[3]);
      }
    }
    const int tok0 = a.t_begin + (warp + j * kWarps) * kStep;
    float qk_scale[kSub], p_scale[kSub];  // per sub-chunk: its page's factors (FP8)
#pragma unroll
    for (int h = 0; h < kSub; ++h) {
      qk_scale[h] = kFp8 ? a.scale_log2 * kFp8Unit : a.scale_log2, p_scale[h] = 1.f;
      if constexpr (kFp8) {
        if (a.page_scales != nullptr) {
          const float* f = wscale + ((j % C::kStages) * kSub + h) * 2;
          qk_scale[h] *= f[0];
          p_scale[h] = f[1];
        }
      }
    }
    uint32_t pa[kSub][kAcc];  // P of sub-chunk h: the A operand of its P V k-step
#pragma unroll
    for (int rh = 0; rh < kRows; ++rh) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < kNB; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = tok0 + n * 8 + 2 * t4 + e;
          float& x = s[n][2 * rh + e];
          x = t < a.valid_end ? x * qk_scale[n / 2] : -INFINITY;
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
      for (int n = 0; n < kNB; ++n) {
        const float p0 = exp2f(s[n][2 * rh] - m_use), p1 = exp2f(s[n][2 * rh + 1] - m_use);
        psum += p0 + p1;
        const float ps = p_scale[n / 2];
        pa[n / 2][(n & 1) * kRows + rh] = kFp8 ? Mma<M>::pack(p0 * ps, p1 * ps) : Mma<M>::pack(p0, p1);
      }
      l_run[rh] = l_run[rh] * alpha + psum;
#pragma unroll
      for (int jd = 0; jd < D / 8; ++jd) {
        o[jd][2 * rh] *= alpha;
        o[jd][2 * rh + 1] *= alpha;
      }
    }
    if constexpr (kFp8) {
      // Matrices: tokens 0-7 / 8-15 of pieces c and c + 1; each register holds tokens
      // (2t4, 2t4 + 1) x dims (2gid, 2gid + 1) of its piece, split into even and odd dims.
      const int tok = (lane & 7) + (((lane >> 3) & 1) << 3), hi = lane >> 4;
#pragma unroll
      for (int c = 0; c < D / 16; c += 2)
#pragma unroll
        for (int h = 0; h < kSub; ++h) {
          uint32_t b[4];
          ldsm_x4_trans(v_s + C::offset(kChunk * h + tok, c + hi), b);
#pragma unroll
          for (int i = 0; i < 4; ++i) b[i] = __byte_perm(b[i], 0, 0x3120);
#pragma unroll
          for (int i = 0; i < 4; ++i)  // block 2(c + i/2) + parity(i & 1)
            Mma<M>::run(o[2 * c + i], pa[h], e4m3x2_to_f16x2(b[i & 2], i & 1),
                        e4m3x2_to_f16x2(b[(i & 2) + 1], i & 1));
        }
    } else {
      const int tok = (lane & 7) + (((lane >> 3) & 1) << 3), hi = lane >> 4;
#pragma unroll
      for (int jd = 0; jd < D / 16; ++jd) {
        uint32_t b[4];
        ldsm_x4_trans(v_s + C::offset(tok, 2 * jd + hi), b);
        Mma<T>::run(o[2 * jd], pa[0], b[0], b[1]);
        Mma<T>::run(o[2 * jd + 1], pa[0], b[2], b[3]);
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
    issue(j + C::kStages - 1, next_pages);
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
      float* dst = sm_acc + (warp * 16 + row) * D;
      if constexpr (kFp8) {  // block 2p + parity, column 2t4 + e: dim 16p + 4t4 + 2e + parity
#pragma unroll
        for (int p = 0; p < D / 16; ++p)
          *reinterpret_cast<float4*>(dst + 16 * p + 4 * t4) =
              make_float4(o[2 * p][2 * rh], o[2 * p + 1][2 * rh], o[2 * p][2 * rh + 1], o[2 * p + 1][2 * rh + 1]);
      } else {
#pragma unroll
        for (int jd = 0; jd < D / 8; ++jd)
          *reinterpret_cast<float2*>(dst + jd * 8 + 2 * t4) = make_float2(o[jd][2 * rh], o[jd][2 * rh + 1]);
      }
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
    if constexpr (kFp8) a0 *= a.out_scale * kFp8Unit, a1 *= a.out_scale * kFp8Unit;
    emit(e, h, a0, a1, mx, den);
  }
  __syncthreads();  // the buffers are free again for the caller
}

}  // namespace pkv
