// Phase stamps of the graph decode's kernels (PKV_TRACE builds, graph_decode.h): the trace
// buffer and the stamps that are more than one field. Included by graph_decode.cu only: the
// kernels and the buffer are internal to that translation unit. Without PKV_TRACE every
// function here is empty and a record is null, so no stamp is compiled.
#pragma once

#include "graph_decode.h"
#include "ptx.cuh"

namespace pkv {
namespace {

#if PKV_TRACE
__device__ unsigned long long g_trace[kTraceRecords * kTraceFields];
#endif

// This CTA's record (record blockIdx.x), its entry time stamped; null past kTraceCtas CTAs and
// without PKV_TRACE.
__device__ __forceinline__ unsigned long long* trace_begin() {
#if PKV_TRACE
  unsigned long long* rec = g_trace + static_cast<int64_t>(blockIdx.x) * kTraceFields;
  if (threadIdx.x == 0 && blockIdx.x < kTraceCtas) rec[0] = globaltimer_ns();
  if (blockIdx.x >= kTraceCtas) rec = nullptr;
  PKV_STAMP(rec, 1);
  return rec;
#else
  return nullptr;
#endif
}

// A CTA without work: its exit time, flags 0.
__device__ __forceinline__ void trace_idle(unsigned long long* rec) {
#if PKV_TRACE
  if (rec != nullptr && threadIdx.x == 0) rec[9] = globaltimer_ns(), rec[10] = 0;
#else
  (void)rec;
#endif
}

#if PKV_TRACE
// A decode CTA's end: clock and exit time, its pieces and in-grid merges, its first piece's
// tokens and its SM.
__device__ __forceinline__ void trace_decode_end(unsigned long long* rec, int pieces, int merged, int first_tokens) {
  if (rec != nullptr && threadIdx.x == 0) {
    rec[8] = clock_now();
    rec[9] = globaltimer_ns();
    rec[10] = 1 | (static_cast<unsigned long long>(pieces) << 8) | (static_cast<unsigned long long>(merged) << 24);
    rec[11] = static_cast<unsigned long long>(first_tokens);
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(smid));
    rec[12] = smid;
  }
}
#define PKV_STAMP_DECODE_END(rec, pieces, merged, first_tokens) trace_decode_end(rec, pieces, merged, first_tokens)
#else
// A macro, not an empty call: the counts it would record are then not arguments of anything
// (an empty inline call with them reordered the optimizer's output).
#define PKV_STAMP_DECODE_END(rec, pieces, merged, first_tokens) ((void)(merged), (void)(first_tokens))
#endif

}  // namespace
}  // namespace pkv
