// Attention of one CTA over one token range of one (row, KV head): the inner loop both
// decode kernels share (16-bit caches here; FP8 caches in attend_fp8.cuh, on the same
// pipeline and warp merge).
//
// The CTA's 4 warps take warp steps of 16-token sub-chunks round-robin; each warp runs its
// own cp.async pipeline (KvPipe: kStages steps deep, XOR-swizzled shared memory) and
// FA2-style tensor-core math: the G query heads of the KV head are the M rows of
// mma.m16n8k16 (kRows = 1: G <= 8 in rows 0..7; kRows = 2: G <= 16), S = Q K^T with K by
// ldmatrix, the S accumulators reused as the A operand of P V, V by ldmatrix.trans.
// Softmax state is FP32 in the log2 domain. At the end the warps' states merge in shared
// memory (merge_warps) and emit(e, h, acc[e], acc[e+1], m, l) receives the CTA's state,
// two elements at a time.
#pragma once

#include <type_traits>

#include "ptx.cuh"
#include "state.cuh"

// Build-time knobs (PKV_NVCC_FLAGS in pkv/kernels.py), for measuring alternatives.
#ifndef PKV_FP8_SUB
#define PKV_FP8_SUB 1
#endif
#ifndef PKV_FP8_STAGES
#define PKV_FP8_STAGES 3
#endif

namespace pkv {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 16;  // tokens per sub-chunk (the mma K of P V); a page factor covers one
constexpr int kTile = 32;   // TILE_TOKENS of pkv.schedule: split bounds are in these tiles
constexpr int kMaxGroup = 16;  // query heads per KV head: the 16 M rows of the MMA

template <int D, bool kFp8 = false> struct AttendCfg {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  static constexpr int kRowBytes = D * (kFp8 ? 1 : 2);  // one token of K (or V)
  static constexpr int kPieces = kRowBytes / 16;        // 16-byte pieces per token row
  // A warp step takes kSub 16-token sub-chunks: FP8 steps take two, so a step moves as
  // many bytes as a 16-bit one.
  static constexpr int kSub = kFp8 ? PKV_FP8_SUB : 1;
  static constexpr int kStepTokens = kSub * kChunk;
  static constexpr int kHalfBytes = kStepTokens * kRowBytes;
  static constexpr int kStageBytes = 2 * kHalfBytes;    // K then V
  static constexpr int kStages = kFp8 ? PKV_FP8_STAGES : 3;
  static constexpr int kSmem = kWarps * kStages * kStageBytes;  // 48 / 96 / 192 KB (16-bit and FP8 alike)
  static constexpr int kCtasPerSm = D == 64 ? 3 : D == 128 ? 2 : 1;
  // At D = 256 the Q fragments would not fit in registers beside the accumulators: Q
  // (<= 8 heads there) waits in shared memory past the pipeline buffers instead.
  static constexpr bool kQInSmem = D > 128;
  static constexpr int kQOffset = kSmem;
  // FP8 page factors (K, V of each sub-chunk's page) land beside each stage, by cp.async.
  static constexpr int kScaleOffset = kQOffset + (kQInSmem ? 8 * D * 2 : 0);
  static constexpr int kSmemTotal = kScaleOffset + (kFp8 ? kWarps * kStages * kSub * 8 : 0);
  // The warps' states (m[16], l[16], acc[16][D] each) reuse the idle pipeline buffers.
  static_assert(kWarps * 16 * (D + 2) * 4 <= kSmem, "warp states must fit in the pipeline buffers");
  static_assert(kRowBytes == 64 || kRowBytes % 128 == 0, "rows of 64 bytes or whole 128-byte lines");
  static_assert(kChunk * kPieces % 32 == 0, "a sub-chunk is whole rounds of 32 lanes");
  // Byte offset of (token, piece) inside a K or V step: XOR swizzle so ldmatrix's 8 row
  // addresses (8 tokens, one piece) hit 8 different 16-byte bank groups. Rows of 64
  // bytes pair up in a 128-byte line: odd tokens take the line's other half.
  static __device__ __forceinline__ int offset(int tok, int piece) {
    const int swz = kRowBytes >= 128 ? tok & 7 : (tok >> 1) & 3;
    return tok * kRowBytes + ((piece ^ swz) << 4);
  }
};

// One token range of one (row, KV head).
struct Range {
  const void* kv;          // K of page 0 (our layout: [pages, 2, Hkv, P, D]); strides below in elements
  const int* bt;           // the row's block-table row
  const void* q;           // the G query heads of this KV head: [G, D]
  int64_t head_off;        // kv_head * head stride (P * D in our layout)
  int64_t page_elems;      // page stride (2 * Hkv * P * D in our layout)
  int64_t v_off;           // V's offset from K (Hkv * P * D in our layout)
  int64_t tok_stride;      // token stride (D in our layout); the last dim is contiguous
  int page_shift;
  int t_begin, t_end;      // tokens read; zero-filled past t_end
  int valid_end;           // tokens at or past it are read and masked
  // Tokens at or past t_fresh may be written by the kernel this launch overlaps (the newest
  // token's K/V, appended just before the decode); the pipeline copies steps wholly before it
  // ahead of griddep_wait, everything else (and Q) after it. 0: nothing before the wait.
  int t_fresh = 0;
  int group;
  float scale_log2;        // log2(e) / sqrt(D), times the K tensor scale (FP8)
  // FP8 only: per-(page, K/V, kv head) factors [pages, 2, Hkv] or null; this range's
  // K factor of page p is at p * 2 Hkv + kv_head, its V factor Hkv later.
  const float* page_scales;
  int scale_head, num_kv_heads;
  float out_scale;         // FP8: the V tensor scale, applied to the CTA's output state
  float cap_log2 = 0.f;    // logits soft cap times log2(e); 0 = off
  unsigned long long* trace = nullptr;  // PKV_TRACE builds: this piece's trace record, or null
  // The pass's query rows (the graph decode's; the defaults are one token of `group` heads that
  // reads every key below valid_end). MMA row m is token m / group, head m % group.
  int rows = 0;              // G x tokens (0: group)
  int64_t q_tok_stride = 0;  // elements between the pass's query tokens (Hq * D)
  int pos0 = -1;             // position of the pass's first token: row m reads keys <= pos0 + m / group
                             // (-1: every key below valid_end)
  int window = -1;           // and keys >= its position - window (-1: no window)
};

__device__ __forceinline__ int pass_rows(const Range& a) { return a.rows ? a.rows : a.group; }
// Element offset of MMA row m's query in a range's q (and out).
__device__ __forceinline__ int64_t q_row_offset(const Range& a, int m, int D) {
  return (m / a.group) * a.q_tok_stride + static_cast<int64_t>(m % a.group) * D;
}
// The keys [lo, hi] MMA row m reads (its token's position, the causal bound and the window), within
// the range's valid keys.
struct KeyBounds {
  int lo, hi;
  __device__ __forceinline__ bool has(int t) const { return t >= lo && t <= hi; }
};
__device__ __forceinline__ KeyBounds key_bounds(const Range& a, int m) {
  if (a.pos0 < 0) return {0, a.valid_end - 1};
  const int pos = a.pos0 + m / a.group;
  return {a.window >= 0 ? pos - a.window : 0, min(pos, a.valid_end - 1)};
}

// Logits soft cap on a log2-domain logit x: c tanh(x / c) is cap tanh(s / cap) scaled by log2(e).
__device__ __forceinline__ float soft_cap(float x, float c) { return c > 0.f ? c * tanhf(x / c) : x; }

// The warp's cp.async pipeline over its steps of a range: step j (the warp's j-th, i.e. the
// range's step warp + j * kWarps) lands in stage j % kStages, K then V, in the cache's own
// element type, plus (FP8 with page factors) each sub-chunk's K and V factor.
template <int D, bool kFp8> struct KvPipe {
  using C = AttendCfg<D, kFp8>;
  struct Pages { int id[C::kSub]; };

  const Range& a;
  const int warp, lane, P, steps;
  const uint32_t base;  // shared address of the warp's stages
  float* const factors; // [kStages][kSub][2] of the warp

  __device__ KvPipe(const Range& r, unsigned char* smem)
      : a(r), warp(threadIdx.x >> 5), lane(threadIdx.x & 31), P(1 << r.page_shift),
        steps(my_steps(r, threadIdx.x >> 5)),
        base(smem_addr(smem + (threadIdx.x >> 5) * C::kStages * C::kStageBytes)),
        factors(reinterpret_cast<float*>(smem + C::kScaleOffset) + (threadIdx.x >> 5) * C::kStages * C::kSub * 2) {}

  static __device__ int my_steps(const Range& r, int w) {
    const int n = (r.t_end - r.t_begin + C::kStepTokens - 1) / C::kStepTokens;
    return n > w ? (n - w + kWarps - 1) / kWarps : 0;
  }
  __device__ int tok0(int j) const { return a.t_begin + (warp + j * kWarps) * C::kStepTokens; }
  __device__ uint32_t k_stage(int j) const { return base + (j % C::kStages) * C::kStageBytes; }
  __device__ uint32_t v_stage(int j) const { return k_stage(j) + C::kHalfBytes; }
  __device__ const float* factors_of(int j) const { return factors + (j % C::kStages) * C::kSub * 2; }

  // Pages of >= 16 tokens hold whole (16-aligned) sub-chunks: one block-table lookup per
  // sub-chunk, loaded an iteration ahead of its use so its latency hides behind the math.
  __device__ Pages pages(int j) const {
    Pages pg;
#pragma unroll
    for (int i = 0; i < C::kSub; ++i)
      pg.id[i] = P >= kChunk && j < steps ? __ldg(a.bt + ((tok0(j) + i * kChunk) >> a.page_shift)) : 0;
    return pg;
  }

  // The pipeline's first kStages - 1 steps, then griddep_wait: steps wholly before a.t_fresh
  // are copied before the wait (under PDL they overlap the previous kernel's tail), the rest
  // after it, in step order (the commit groups stay in order). Q is read after this.
  __device__ void prologue(const Pages (&pro)[C::kStages - 1]) const {
#pragma unroll
    for (int j = 0; j < C::kStages - 1; ++j)
      if (tok0(j) + C::kStepTokens <= a.t_fresh) issue(j, pro[j]);
    griddep_wait();
#pragma unroll
    for (int j = 0; j < C::kStages - 1; ++j)
      if (tok0(j) + C::kStepTokens > a.t_fresh) issue(j, pro[j]);
  }

  __device__ void issue(int j, const Pages& pg) const {
    using KvT = std::conditional_t<kFp8, unsigned char, unsigned short>;
    if (j < steps) {
      const KvT* kv = reinterpret_cast<const KvT*>(a.kv);
      const int t0 = tok0(j);
      const uint32_t stage = k_stage(j);
      if (P >= kChunk && t0 + C::kStepTokens <= a.t_end) {
        // A whole step inside the range and each sub-chunk inside one page (t0 is
        // 16-aligned): one address per sub-chunk, then a pointer step per copy, no
        // per-copy page lookup, wrap or bound (that address work was on the issue path of
        // the prologue and of every step).
        constexpr int kTokPerIt = 32 / C::kPieces, kIts = kChunk * C::kPieces / 32;
        const int lane_tok = lane / C::kPieces, piece = lane % C::kPieces;
        const int64_t it_step = kTokPerIt * a.tok_stride;
#pragma unroll
        for (int i = 0; i < C::kSub; ++i) {
          const KvT* src = kv + pg.id[i] * a.page_elems + a.head_off +
                           (((t0 + i * kChunk) & (P - 1)) + lane_tok) * a.tok_stride + piece * (16 / sizeof(KvT));
#pragma unroll
          for (int it = 0; it < kIts; ++it, src += it_step) {
            const uint32_t dst = stage + C::offset(i * kChunk + it * kTokPerIt + lane_tok, piece);
            cp_async16(dst, src);
            cp_async16(dst + C::kHalfBytes, src + a.v_off);
          }
        }
      } else {  // the range's last step, or pages under 16 tokens: per-copy page and bound
#pragma unroll
        for (int it = 0; it < C::kStepTokens * C::kPieces / 32; ++it) {
          const int idx = it * 32 + lane;
          const int tok = idx / C::kPieces, piece = idx % C::kPieces;
          const int t = t0 + tok;
          const bool ok = t < a.t_end;
          const int page = P >= kChunk ? pg.id[it * 32 / (kChunk * C::kPieces)]
                                       : (ok ? __ldg(a.bt + (t >> a.page_shift)) : 0);
          const KvT* src = kv + page * a.page_elems + a.head_off + (t & (P - 1)) * a.tok_stride + piece * (16 / sizeof(KvT));
          const uint32_t dst = stage + C::offset(tok, piece);
          cp_async16(dst, ok ? src : kv, ok ? 16 : 0);
          cp_async16(dst + C::kHalfBytes, ok ? src + a.v_off : kv, ok ? 16 : 0);
        }
      }
      if constexpr (kFp8) {
        // Each sub-chunk's page factors travel with its bytes (pages of >= 16 tokens: the
        // host refuses page factors on smaller pages).
        if (a.page_scales != nullptr && lane < C::kSub) {
          const float* f = a.page_scales + static_cast<int64_t>(pg.id[lane]) * 2 * a.num_kv_heads + a.scale_head;
          const uint32_t s_dst = smem_addr(factors + ((j % C::kStages) * C::kSub + lane) * 2);
          cp_async4(s_dst, f);
          cp_async4(s_dst + 4, f + a.num_kv_heads);
        }
      }
    }
    cp_async_commit();  // empty groups keep the wait count uniform
  }
};

// The CTA's state from its warps' (m, l, acc) rows, already written to shared memory at
// sm_m[w * 16 + h], sm_l[w * 16 + h], sm_acc[(w * 16 + h) * D + d]; the caller synced.
template <int D, class Emit>
__device__ __forceinline__ void merge_warps(const float* sm, int G, float out_scale, Emit&& emit) {  // G: the rows
  const float* sm_m = sm;
  const float* sm_l = sm_m + kWarps * 16;
  const float* sm_acc = sm_l + kWarps * 16;
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
    emit(e, h, a0 * out_scale, a1 * out_scale, mx, den);
  }
  __syncthreads();  // the buffers are free again for the caller
}

template <typename T, int D, int kRows, class Emit>
__device__ __forceinline__ void attend_range(const Range& a, unsigned char* smem, Emit&& emit) {
  using C = AttendCfg<D>;
  constexpr int kAcc = 2 * kRows;  // accumulator floats per lane per 8-column block
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int G = pass_rows(a);  // MMA rows in use
  const KvPipe<D, false> pipe(a, smem);

  float o[D / 8][kAcc];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < kAcc; ++e) o[j][e] = 0.f;
  float m_run[kRows], l_run[kRows];
#pragma unroll
  for (int rh = 0; rh < kRows; ++rh) m_run[rh] = -INFINITY, l_run[rh] = 0.f;

  // The prologue's page ids in one round of loads, then its copies.
  typename KvPipe<D, false>::Pages pro[C::kStages - 1];
  PKV_STAMP(a.trace, 14);  // the piece is set up: its page ids are requested now
#pragma unroll
  for (int j = 0; j < C::kStages - 1; ++j) pro[j] = pipe.pages(j);
  PKV_STAMP_AFTER(a.trace, 15, pro[0].id[0]);  // the block-table round trip
  pipe.prologue(pro);
  PKV_STAMP(a.trace, 4);  // the block-table round trip and the wait are behind us

  // Q as A fragments (register khalf * kRows + rh holds row gid + 8 rh, columns
  // 16k + 8 khalf + 2 t4 ..+1; zero past G), loaded after the first KV copies are in
  // flight so the two latencies overlap.
  const T* qsrc = reinterpret_cast<const T*>(a.q);
  if constexpr (C::kQInSmem) {  // rows packed: row m at m * D
    T* qs = reinterpret_cast<T*>(smem + C::kQOffset);
    for (int i = threadIdx.x; i < G * D / 8; i += kThreads)
      reinterpret_cast<uint4*>(qs)[i] = *reinterpret_cast<const uint4*>(qsrc + q_row_offset(a, i / (D / 8), D) + i % (D / 8) * 8);
    __syncthreads();
    qsrc = qs;
  }
  int64_t q_at[kRows];  // this lane's rows' offsets in qsrc (-1: a row past G, zero)
  KeyBounds keys[kRows];
#pragma unroll
  for (int rh = 0; rh < kRows; ++rh) {
    const int row = gid + 8 * rh;
    q_at[rh] = row < G ? (C::kQInSmem ? static_cast<int64_t>(row) * D : q_row_offset(a, row, D)) : -1;
    keys[rh] = key_bounds(a, row);
  }
  auto q_frag = [&](int k, uint32_t (&f)[kAcc]) {
#pragma unroll
    for (int kh = 0; kh < 2; ++kh)
#pragma unroll
      for (int rh = 0; rh < kRows; ++rh)
        f[kh * kRows + rh] =
            q_at[rh] >= 0 ? *reinterpret_cast<const uint32_t*>(qsrc + q_at[rh] + 16 * k + 8 * kh + 2 * t4) : 0u;
  };
  uint32_t qa[C::kQInSmem ? 1 : D / 16][kAcc];
  if constexpr (!C::kQInSmem) {
#pragma unroll
    for (int k = 0; k < D / 16; ++k) q_frag(k, qa[k]);
  }

  for (int j = 0; j < pipe.steps; ++j) {
    const auto next_pages = pipe.pages(j + C::kStages - 1);
    cp_async_wait<C::kStages - 2>();
    __syncwarp();
    if (j == 0) PKV_STAMP(a.trace, 5);  // warp 0's first KV step has landed
    const uint32_t k_s = pipe.k_stage(j), v_s = pipe.v_stage(j);

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
    const int tok0 = pipe.tok0(j);
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
          x = keys[rh].has(t) ? soft_cap(x * a.scale_log2, a.cap_log2) : -INFINITY;
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
    pipe.issue(j + C::kStages - 1, next_pages);
  }
  PKV_STAMP(a.trace, 6);  // warp 0's last step done
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
  merge_warps<D>(sm_m, G, 1.f, emit);
}

}  // namespace pkv
