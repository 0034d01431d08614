// PTX helpers shared by the decode kernels: async copies, ldmatrix, the m16n8k16 MMA,
// thread-block-cluster access. Torch-free; device code only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

// Diagnosis build knob (graph_decode.h): phase stamps of the decode kernels.
#ifndef PKV_TRACE
#define PKV_TRACE 0
#endif

namespace pkv {

__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t)::"memory");
  return t;
}
__device__ __forceinline__ unsigned long long clock_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(t)::"memory");
  return t;
}
// Thread 0 stamps field i of a trace record (a null record: no stamp); nothing without PKV_TRACE.
#if PKV_TRACE
#define PKV_STAMP(rec, i)                                                          \
  do {                                                                             \
    if ((rec) != nullptr && threadIdx.x == 0) (rec)[i] = ::pkv::clock_now();       \
  } while (0)
// Stamps field i once the value v has arrived (a dependent instruction waits for its load):
// the round trip of a load, not only its issue.
#define PKV_STAMP_AFTER(rec, i, v)                                                 \
  do {                                                                             \
    if ((rec) != nullptr && threadIdx.x == 0) {                                    \
      unsigned pkv_v_ = static_cast<unsigned>(v);                                  \
      asm volatile("mov.b32 %0, %0;\n" : "+r"(pkv_v_)::"memory");                  \
      (rec)[i] = ::pkv::clock_now();                                               \
    }                                                                              \
  } while (0)
#else
#define PKV_STAMP(rec, i) \
  do {                    \
  } while (0)
#define PKV_STAMP_AFTER(rec, i, v) \
  do {                             \
  } while (0)
#endif

// Asks for the 128-byte line holding p to be brought into L2; no register waits on it.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes == 0 zero-fills (tokens past the task's range), so
// shared memory never holds stale values that could turn 0 * x into NaN.
// PKV_L2_PREFETCH (a build knob, pkv/kernels.py): 0, or 64 / 128 / 256 to ask L2 to fetch
// that many bytes around each miss.
#ifndef PKV_L2_PREFETCH
#define PKV_L2_PREFETCH 0
#endif
#if PKV_L2_PREFETCH == 256
#define PKV_CP_ASYNC_CG "cp.async.cg.shared.global.L2::256B"
#elif PKV_L2_PREFETCH == 128
#define PKV_CP_ASYNC_CG "cp.async.cg.shared.global.L2::128B"
#elif PKV_L2_PREFETCH == 64
#define PKV_CP_ASYNC_CG "cp.async.cg.shared.global.L2::64B"
#else
#define PKV_CP_ASYNC_CG "cp.async.cg.shared.global"
#endif
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile(PKV_CP_ASYNC_CG " [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// The same, all 16 bytes in bounds (no zero-fill operand).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile(PKV_CP_ASYNC_CG " [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
// 4-byte async copy (through L1: .cg takes 16 bytes only); used for the FP8 page scales.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
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

// Transpose of an 8x8 b16 matrix held one row pair per lane (the mma fragment layout).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// mma.sync m16n8k16 with FP32 accumulators. kRows = 1: only A/C rows 0..7 are live (a
// GQA group of <= 8 query heads; rows 8..15 are zero in, discarded out, and cost no
// registers); kRows = 2: all 16 rows (groups of 9..16).
template <typename T> struct Mma;

#define PKV_MMA_SPECIALIZATION(TYPE, PTX_TYPE, PACK2, FROM_FLOAT)                                       \
  template <> struct Mma<TYPE> {                                                                                \
    static __device__ __forceinline__ void run(float (&d)[2], const uint32_t (&a)[2], uint32_t b0, uint32_t b1) { \
      asm volatile("{ .reg .f32 x2, x3;\n"                                                                       \
                   "mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE                              \
                   ".f32 {%0,%1,x2,x3}, {%2,%3,%4,%3}, {%5,%6}, {%0,%1,%7,%7};\n}\n"                            \
                   : "+f"(d[0]), "+f"(d[1])                                                                      \
                   : "r"(a[0]), "r"(0u), "r"(a[1]), "r"(b0), "r"(b1), "f"(0.f));                                \
    }                                                                                                           \
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE                               \
                   ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                              \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                              \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                              \
    }                                                                                                           \
    static __device__ __forceinline__ uint32_t pack(float x, float y) {                                         \
      auto h = PACK2(x, y);                                                                                     \
      return *reinterpret_cast<uint32_t*>(&h);                                                                  \
    }                                                                                                           \
    static __device__ __forceinline__ void store2(TYPE* p, float x, float y) {                                  \
      *reinterpret_cast<decltype(PACK2(x, y))*>(p) = PACK2(x, y);                                               \
    }                                                                                                           \
    static __device__ __forceinline__ TYPE from_float(float x) { return FROM_FLOAT(x); }                       \
  };

PKV_MMA_SPECIALIZATION(__half, "f16", __floats2half2_rn, __float2half_rn)
PKV_MMA_SPECIALIZATION(__nv_bfloat16, "bf16", __floats2bfloat162_rn, __float2bfloat16_rn)
#undef PKV_MMA_SPECIALIZATION

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

// atomicAdd with release (the caller's earlier writes, and those a barrier ordered before it,
// are visible first) and acquire (later reads see what the other adders released) at GPU scope.
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
// A GPU-scope acquire load: later reads see what the releasers of the value read published.
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Programmatic dependent launch (sm_90 and up; no-ops in a launch without a programmatic
// dependency). griddep_wait: the kernel queued before this one has completed and its writes are
// visible. griddep_launch_dependents: a kernel launched after this one as a programmatic
// dependent may start once every CTA of this grid has issued it (or exited); it still waits at
// its own griddep_wait for this grid's completion.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace pkv
