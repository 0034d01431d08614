// Attention of one CTA over one token range of one (row, KV head) of an FP8 (e4m3) cache:
// half the bytes of a 16-bit cache, widened to fp16 in registers for the tensor cores.
//
// The MMA roles are swapped against attend_range (as decode kernels for small GQA groups
// do): the KV tokens fill mma.m16n8k16's 16 M rows and the query heads its 8 N columns
// (kHB blocks of 8: G <= 8 or G <= 16), so no MMA row is padding and none needs zeroing:
//   S^T = K Q^T       A = K   [16 tokens x 16 dims], ldmatrix from the e4m3 bytes;
//                     B = Q^T [16 dims x 8 heads], registers loaded once.
//   O^T += V^T P^T    A = V^T [16 dims x 16 tokens], ldmatrix.trans from the e4m3 bytes;
//                     B = P^T [16 tokens x 8 heads]: the S^T accumulators packed to fp16,
//                     transposed in registers (movmatrix).
// Widening: ldmatrix reads the bytes as b16 pairs and cvt.rn.f16x2.e4m3x2 widens a pair.
//  - K: lane (gid, t4) gets token gid, bytes 4t4..4t4+3 of a 16-dim piece. Taken as the
//    fragment's k = 2t4, 2t4+1 | 2t4+8, 2t4+9 this permutes the reduction (head_dim) inside
//    each piece; Q^T's fragments are loaded with the same permutation.
//  - V: ldmatrix.trans gives lane (gid, t4) tokens 2t4, 2t4+1 of dims 2gid, 2gid+1; one
//    byte_perm splits them into the even dim (A row gid) and the odd dim (A row gid + 8),
//    so O^T row gid of piece p is dim 16p + 2gid and row gid + 8 is dim 16p + 2gid + 1.
// The softmax runs on S^T: a lane holds tokens gid, gid + 8 of each sub-chunk for heads
// 2t4, 2t4 + 1, so a head's max and sum reduce over the 8 lanes of equal t4.
// Scales (pkv/fp8.py): the K tensor scale is in scale_log2, a page's K factor multiplies
// its scores, its V factor its P before the fp16 pack (l sums P unscaled), and the V
// tensor scale the CTA's output state.
#pragma once

#include "attend.cuh"

namespace pkv {

// Diagnosis knob (PKV_NVCC_FLAGS, wrong results): 1 = no widening (the bytes reinterpreted),
// 2 = no math at all (only the copies and the waits).
#ifndef PKV_FP8_DIAG
#define PKV_FP8_DIAG 0
#endif

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x, bool hi) {
#if PKV_FP8_DIAG == 1
  return hi ? x : x ^ 0x3c003c00u;
#else
  const unsigned short pair = static_cast<unsigned short>(hi ? x >> 16 : x & 0xffffu);
  uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(pair));
  return r;
#endif
}

// Two adjacent query elements as fp16x2 (bf16 queries run fp16 math against an FP8 cache:
// e4m3 values and P are exact or better in fp16).
template <typename T> __device__ __forceinline__ uint32_t q_f16x2(const T* p) {
  if constexpr (std::is_same_v<T, __half>) {
    return *reinterpret_cast<const uint32_t*>(p);
  } else {
    const __half2 h = __float22half2_rn(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p)));
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

template <typename T, int D, int kHB, class Emit>
__device__ __forceinline__ void attend_range_fp8(const Range& a, unsigned char* smem, Emit&& emit) {
  using C = AttendCfg<D, true>;
  static_assert(!C::kQInSmem, "the FP8 path is built for head_dim <= 128");
  constexpr int kSub = C::kSub, kPc = D / 16;  // sub-chunks per step; 16-dim pieces
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int G = pass_rows(a);  // query rows in use (the N columns)
  const KvPipe<D, true> pipe(a, smem);

  float o[kHB][kPc][4];  // O^T: rows dims 16p + 2gid (+1 for [2], [3]), columns heads 8hb + 2t4 (+1)
#pragma unroll
  for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
    for (int p = 0; p < kPc; ++p)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[hb][p][e] = 0.f;
  float m_run[kHB][2], l_run[kHB][2];  // heads 8hb + 2t4 + e
#pragma unroll
  for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
    for (int e = 0; e < 2; ++e) m_run[hb][e] = -INFINITY, l_run[hb][e] = 0.f;

  typename KvPipe<D, true>::Pages pro[C::kStages - 1];  // the prologue's page ids in one round
  PKV_STAMP(a.trace, 14);  // the piece is set up: its page ids are requested now
#pragma unroll
  for (int j = 0; j < C::kStages - 1; ++j) pro[j] = pipe.pages(j);
  PKV_STAMP_AFTER(a.trace, 15, pro[0].id[0]);  // the block-table round trip
  pipe.prologue(pro);
  PKV_STAMP(a.trace, 4);

  // Q^T B fragments: head 8hb + gid, dims 16p + 4t4 (+1) and 16p + 4t4 + 2 (+1); zero past
  // G. Loaded after the first KV copies are in flight so the two latencies overlap.
  const T* q = reinterpret_cast<const T*>(a.q);
  uint32_t qb[kHB][kPc][2];
#pragma unroll
  for (int hb = 0; hb < kHB; ++hb) {
    const int head = 8 * hb + gid;
    const T* qh = q + (head < G ? q_row_offset(a, head, D) : 0);
#pragma unroll
    for (int p = 0; p < kPc; ++p)
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) qb[hb][p][kh] = head < G ? q_f16x2(qh + 16 * p + 4 * t4 + 2 * kh) : 0u;
  }
  KeyBounds keys[kHB][2];  // the keys of this lane's columns (query rows 8hb + 2t4 + e)
#pragma unroll
  for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
    for (int e = 0; e < 2; ++e) keys[hb][e] = key_bounds(a, 8 * hb + 2 * t4 + e);
  // This lane's ldmatrix row: matrices (tokens 0-7 | 8-15) x (piece p | p + 1).
  const int ltok = (lane & 7) + (((lane >> 3) & 1) << 3), lhi = lane >> 4;

  for (int j = 0; j < pipe.steps; ++j) {
    const auto next_pages = pipe.pages(j + C::kStages - 1);
    cp_async_wait<C::kStages - 2>();
    __syncwarp();
    if (j == 0) PKV_STAMP(a.trace, 5);
    const uint32_t k_s = pipe.k_stage(j), v_s = pipe.v_stage(j);
#if PKV_FP8_DIAG == 2
    if (j >= 0) {  // keep one ldmatrix so the stage is consumed, skip the math
      uint32_t b[4];
      ldsm_x4(k_s + C::offset(ltok, lhi), b);
      o[0][0][0] += __uint_as_float(b[0] & 0x3fffffffu) * 1e-30f;
      __syncwarp();
      pipe.issue(j + C::kStages - 1, next_pages);
      continue;
    }
#endif

    float s[kHB][kSub][4];  // S^T of sub-chunk h: tokens 16h + gid ([0], [1]) and + 8 ([2], [3])
#pragma unroll
    for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
      for (int h = 0; h < kSub; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[hb][h][e] = 0.f;
#pragma unroll
    for (int p = 0; p < kPc; p += 2)
#pragma unroll
      for (int h = 0; h < kSub; ++h) {
        uint32_t b[4];
        ldsm_x4(k_s + C::offset(kChunk * h + ltok, p + lhi), b);
#pragma unroll
        for (int i = 0; i < 2; ++i) {  // piece p + i: tokens 0-7 in b[2i], 8-15 in b[2i + 1]
          const uint32_t af[4] = {e4m3x2_to_f16x2(b[2 * i], false), e4m3x2_to_f16x2(b[2 * i + 1], false),
                                  e4m3x2_to_f16x2(b[2 * i], true), e4m3x2_to_f16x2(b[2 * i + 1], true)};
#pragma unroll
          for (int hb = 0; hb < kHB; ++hb) Mma<__half>::run(s[hb][h], af, qb[hb][p + i][0], qb[hb][p + i][1]);
        }
      }

    const int tok0 = pipe.tok0(j);
    float qk_scale[kSub], p_scale[kSub];
#pragma unroll
    for (int h = 0; h < kSub; ++h) {
      qk_scale[h] = a.scale_log2, p_scale[h] = 1.f;
      if (a.page_scales != nullptr) {
        const float* f = pipe.factors_of(j) + 2 * h;
        qk_scale[h] *= f[0];
        p_scale[h] = f[1];
      }
    }
    uint32_t pb[kHB][kSub][2];  // P^T B fragments of sub-chunk h: tokens 2t4.. and 8 + 2t4.., head gid
#pragma unroll
    for (int hb = 0; hb < kHB; ++hb) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int h = 0; h < kSub; ++h)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int t = tok0 + kChunk * h + 8 * r + gid;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[hb][h][2 * r + e];
            x = keys[hb][e].has(t) ? soft_cap(x * qk_scale[h], a.cap_log2) : -INFINITY;
            mx[e] = fmaxf(mx[e], x);
          }
        }
      float m_use[2], alpha[2], psum[2] = {0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int sh = 4; sh < 32; sh <<= 1) mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], sh));
        const float m_new = fmaxf(m_run[hb][e], mx[e]);
        m_use[e] = m_new == -INFINITY ? 0.f : m_new;  // a fully masked prefix stays neutral
        alpha[e] = exp2f(m_run[hb][e] - m_use[e]);
        m_run[hb][e] = m_new;
      }
#pragma unroll
      for (int h = 0; h < kSub; ++h)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float p0 = exp2f(s[hb][h][2 * r] - m_use[0]), p1 = exp2f(s[hb][h][2 * r + 1] - m_use[1]);
          psum[0] += p0, psum[1] += p1;
          pb[hb][h][r] = movmatrix_trans(Mma<__half>::pack(p0 * p_scale[h], p1 * p_scale[h]));
        }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        l_run[hb][e] = l_run[hb][e] * alpha[e] + psum[e];
#pragma unroll
        for (int p = 0; p < kPc; ++p) o[hb][p][e] *= alpha[e], o[hb][p][2 + e] *= alpha[e];
      }
    }

#pragma unroll
    for (int p = 0; p < kPc; p += 2)
#pragma unroll
      for (int h = 0; h < kSub; ++h) {
        uint32_t b[4];
        ldsm_x4_trans(v_s + C::offset(kChunk * h + ltok, p + lhi), b);
#pragma unroll
        for (int i = 0; i < 2; ++i) {  // piece p + i: tokens 0-7 in b[2i], 8-15 in b[2i + 1]
          const uint32_t x0 = __byte_perm(b[2 * i], 0, 0x3120), x1 = __byte_perm(b[2 * i + 1], 0, 0x3120);
          const uint32_t af[4] = {e4m3x2_to_f16x2(x0, false), e4m3x2_to_f16x2(x0, true),
                                  e4m3x2_to_f16x2(x1, false), e4m3x2_to_f16x2(x1, true)};
#pragma unroll
          for (int hb = 0; hb < kHB; ++hb) Mma<__half>::run(o[hb][p + i], af, pb[hb][h][0], pb[hb][h][1]);
        }
      }
    __syncwarp();  // every lane is done with this stage before it is refilled
    pipe.issue(j + C::kStages - 1, next_pages);
  }
  PKV_STAMP(a.trace, 6);
  cp_async_wait<0>();
#pragma unroll
  for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int sh = 4; sh < 32; sh <<= 1) l_run[hb][e] += __shfl_xor_sync(0xffffffffu, l_run[hb][e], sh);

  // The warps' states to the (now idle) pipeline buffers, in natural dim order; then the
  // CTA merge.
  __syncthreads();
  float* sm_m = reinterpret_cast<float*>(smem);
  float* sm_l = sm_m + kWarps * 16;
  float* sm_acc = sm_l + kWarps * 16;
#pragma unroll
  for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int head = 8 * hb + 2 * t4 + e;
      if (head < G) {
        if (gid == 0) sm_m[warp * 16 + head] = m_run[hb][e], sm_l[warp * 16 + head] = l_run[hb][e];
#pragma unroll
        for (int p = 0; p < kPc; ++p)
          *reinterpret_cast<float2*>(sm_acc + (warp * 16 + head) * D + 16 * p + 2 * gid) =
              make_float2(o[hb][p][e], o[hb][p][2 + e]);
      }
    }
  __syncthreads();
  merge_warps<D>(sm_m, G, a.out_scale, emit);
}

}  // namespace pkv
