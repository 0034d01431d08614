// The one torch-facing file: unpacks tensors into pkv::DecodeParams / MergeParams and
// launches on the current stream. Shape and range checks live in the engines (pkv/engines/);
// here only what would otherwise be undefined behaviour is checked.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "graph_decode.h"
#include "pkv_decode.h"
#include "roofline.h"

namespace {

pkv::DType dtype_of(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return pkv::DType::kFloat16;
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "pkv: only float16 and bfloat16 are supported");
  return pkv::DType::kBFloat16;
}

const int* meta_ptr(const at::Tensor& meta, int64_t off) {
  if (off < 0) return nullptr;
  TORCH_CHECK(off < meta.numel(), "pkv: metadata offset out of range");
  return meta.data_ptr<int>() + off;
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "pkv: ", name, " must be a contiguous CUDA tensor");
}

void decode(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table, const at::Tensor& meta,
            const at::Tensor& out, const at::Tensor& partial, const at::Tensor& counters, int64_t seq_lens_off,
            int64_t req_ids_off, int64_t rows_off, int64_t tasks_off, int64_t seg_off, int64_t num_rows,
            int64_t splits, int64_t num_slots, int64_t bound_len, int64_t group, int64_t page_shift, bool qo_indexed,
            bool early_exit, int64_t mode) {
  check_cuda(q, "q"); check_cuda(kv, "kv"); check_cuda(block_table, "block_table"); check_cuda(meta, "meta");
  check_cuda(out, "out");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() && out.scalar_type() == q.scalar_type(), "pkv: dtype mismatch");
  TORCH_CHECK(meta.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt, "pkv: int32 metadata expected");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && q.dim() == 3, "pkv: kv[pages,2,Hkv,P,D] and q[B,Hq,D] expected");
  const int head_dim = static_cast<int>(kv.size(4));
  const at::cuda::CUDAGuard guard(q.device());

  pkv::DecodeParams p{};
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.kv = kv.data_ptr();
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride = block_table.size(1);
  p.seq_lens = meta_ptr(meta, seq_lens_off);
  p.req_ids = meta_ptr(meta, req_ids_off);
  p.rows = meta_ptr(meta, rows_off);
  p.tasks = meta_ptr(meta, tasks_off);
  p.seg_offsets = meta_ptr(meta, seg_off);
  p.partial = partial.numel() ? partial.data_ptr<float>() : nullptr;
  p.counters = counters.numel() ? counters.data_ptr<int>() : nullptr;
  TORCH_CHECK(mode >= 0 && mode <= static_cast<int64_t>(pkv::OutMode::kCluster), "pkv.decode: unknown mode ", mode);
  p.num_rows = static_cast<int>(num_rows);
  p.splits = static_cast<int>(splits);
  p.num_slots = static_cast<int>(num_slots);
  p.bound_len = static_cast<int>(bound_len);
  p.num_kv_heads = static_cast<int>(kv.size(2));
  p.group = static_cast<int>(group);
  p.page_shift = static_cast<int>(page_shift);
  p.qo_indexed = qo_indexed ? 1 : 0;
  p.early_exit = early_exit ? 1 : 0;
  p.mode = static_cast<pkv::OutMode>(mode);
  p.scale_log2 = static_cast<float>(M_LOG2E / std::sqrt(static_cast<double>(head_dim)));
  TORCH_CHECK(p.seq_lens && p.req_ids && (p.rows || p.tasks), "pkv.decode: missing metadata");
  TORCH_CHECK(p.mode == pkv::OutMode::kDirect || p.mode == pkv::OutMode::kCluster || p.partial,
              "pkv.decode: partial workspace needed");
  TORCH_CHECK(p.mode != pkv::OutMode::kFused || (p.counters && p.seg_offsets), "pkv.decode: fused needs counters");
  const cudaError_t err = pkv::launch_decode(p, dtype_of(q), head_dim, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "pkv.decode launch failed: ", cudaGetErrorString(err));
}

void merge(const at::Tensor& partial, const at::Tensor& meta, const at::Tensor& out, int64_t seg_off, int64_t rows_off,
           int64_t num_rows, int64_t num_kv_heads, int64_t num_slots, int64_t group, int64_t qo_indexed) {
  check_cuda(partial, "partial"); check_cuda(meta, "meta"); check_cuda(out, "out");
  TORCH_CHECK(partial.scalar_type() == at::kFloat && meta.scalar_type() == at::kInt, "pkv.merge: dtypes");
  const at::cuda::CUDAGuard guard(out.device());
  pkv::MergeParams p{};
  p.partial = partial.data_ptr<float>();
  p.seg_offsets = meta_ptr(meta, seg_off);
  p.rows = meta_ptr(meta, rows_off);
  p.out = out.data_ptr();
  p.num_rows = static_cast<int>(num_rows);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.group = static_cast<int>(group);
  p.num_slots = static_cast<int>(num_slots);
  p.qo_indexed = static_cast<int>(qo_indexed);
  TORCH_CHECK(p.seg_offsets && (p.rows || !p.qo_indexed), "pkv.merge: missing metadata");
  const cudaError_t err = pkv::launch_merge(p, dtype_of(out), static_cast<int>(out.size(2)),
                                            c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "pkv.merge launch failed: ", cudaGetErrorString(err));
}

// Named arguments; the step's split is decided by the kernel from seq_lens. K and V are
// [num_pages, Hkv, P, D] views with any page, head and token strides (one tensor's halves,
// a (K, V) pair, or another layout seen through permuted views); the last dim is contiguous.
void graph_decode_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& block_table,
                        const at::Tensor& seq_lens, const at::Tensor& req_ids, const at::Tensor& out,
                        const std::optional<at::Tensor>& lse, const at::Tensor& partial, const at::Tensor& counters,
                        int64_t num_ctas, int64_t min_tiles, const std::optional<at::Tensor>& page_scales,
                        double k_scale, double v_scale, double sm_scale, double logits_soft_cap,
                        int64_t piece_cost, int64_t counter_stride, int64_t spin_ns, bool pdl, int64_t window_left,
                        int64_t q_len, const std::optional<at::Tensor>& sinks, int64_t short_tiles) {
  check_cuda(q, "q"); check_cuda(block_table, "block_table"); check_cuda(seq_lens, "seq_lens");
  check_cuda(req_ids, "req_ids"); check_cuda(out, "out"); check_cuda(partial, "partial"); check_cuda(counters, "counters");
  TORCH_CHECK(k.is_cuda() && v.is_cuda() && k.dim() == 4 && k.sizes() == v.sizes() && k.strides() == v.strides() &&
                  k.scalar_type() == v.scalar_type() && k.stride(3) == 1,
              "pkv.graph_decode: K and V must be CUDA [num_pages, Hkv, P, D] views of one dtype and strides, "
              "last dim contiguous");
  const int64_t esize = k.element_size();
  const bool aligned = reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 == 0 && k.stride(0) * esize % 16 == 0 &&
                       k.stride(1) * esize % 16 == 0 && k.stride(2) * esize % 16 == 0;
  TORCH_CHECK(aligned, "pkv.graph_decode: K/V pages, heads and tokens must start on 16-byte boundaries");
  const bool fp8 = k.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((fp8 || q.scalar_type() == k.scalar_type()) && out.scalar_type() == q.scalar_type(),
              "pkv: dtype mismatch (kv is q's dtype or float8_e4m3fn; out is q's)");
  TORCH_CHECK(!fp8 || k.size(3) <= pkv::kFp8MaxHeadDim, "pkv.graph_decode: an FP8 cache is built for head_dim <= ",
              pkv::kFp8MaxHeadDim);
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0 && !page_scales), "pkv.graph_decode: scales need an FP8 cache");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && req_ids.scalar_type() == at::kInt &&
              block_table.scalar_type() == at::kInt && counters.scalar_type() == at::kInt, "pkv: int32 metadata expected");
  TORCH_CHECK(partial.scalar_type() == at::kFloat, "pkv.graph_decode: float32 partial workspace expected");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "pkv: q, out [B * q_len,Hq,D] expected");
  TORCH_CHECK(q_len >= 1 && q_len <= pkv::kMaxQLen && q.size(0) % q_len == 0, "pkv.graph_decode: q_len is 1..",
              pkv::kMaxQLen, " and divides q's rows, got ", q_len);
  TORCH_CHECK(window_left >= -1 && window_left < (int64_t{1} << 30), "pkv.graph_decode: window_left >= -1, got ",
              window_left);
  const int64_t rows = q.size(0) / q_len, H = k.size(1), D = k.size(3);
  TORCH_CHECK(seq_lens.numel() == rows && req_ids.numel() == rows, "pkv.graph_decode: seq_lens/req_ids need B entries");
  TORCH_CHECK(q.size(1) % H == 0 && q.size(2) == D, "pkv.graph_decode: q heads/head_dim do not match kv");
  const int64_t G = q.size(1) / H;
  const int q_block = pkv::graph_query_block(static_cast<int>(G), static_cast<int>(D), static_cast<int>(q_len));
  const int q_blocks = static_cast<int>((q_len + q_block - 1) / q_block);
  const int64_t slot_rows = G * q_block;  // query rows a partial state holds
  TORCH_CHECK(counters.numel() >= rows * H * pkv::kMaxCounterStride, "pkv.graph_decode: counters need B * Hkv * ",
              pkv::kMaxCounterStride, " entries");
  TORCH_CHECK(partial.numel() >= pkv::acc_offset(2 * num_ctas, slot_rows) + 2 * num_ctas * slot_rows * D,
              "pkv.graph_decode: partial workspace too small for num_ctas and q_len");
  const int64_t P = k.size(2);
  TORCH_CHECK(P > 0 && (P & (P - 1)) == 0, "pkv: page size must be a power of two");
  if (lse) {
    check_cuda(*lse, "lse");
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->numel() == q.size(0) * q.size(1),
                "pkv.graph_decode: lse [B * q_len, Hq] float32");
  }
  if (sinks) {
    check_cuda(*sinks, "sinks");
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->numel() == q.size(1), "pkv.graph_decode: sinks [Hq] float32");
  }
  TORCH_CHECK(sm_scale > 0 && logits_soft_cap >= 0, "pkv.graph_decode: sm_scale > 0 and logits_soft_cap >= 0");
  const at::cuda::CUDAGuard guard(q.device());
  pkv::GraphDecodeParams p{};
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.kv = k.data_ptr();
  p.v = v.data_ptr();
  p.page_stride = k.stride(0);
  p.head_stride = k.stride(1);
  p.token_stride = k.stride(2);
  p.lse = lse ? lse->data_ptr<float>() : nullptr;
  p.soft_cap_log2 = static_cast<float>(logits_soft_cap * M_LOG2E);
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride = block_table.size(1);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.req_ids = req_ids.data_ptr<int>();
  p.partial = partial.data_ptr<float>();
  p.counters = counters.data_ptr<int>();
  p.num_rows = static_cast<int>(rows);
  p.num_kv_heads = static_cast<int>(H);
  p.group = static_cast<int>(G);
  p.page_shift = 63 - __builtin_clzll(static_cast<unsigned long long>(P));
  p.num_ctas = static_cast<int>(num_ctas);
  p.min_tiles = static_cast<int>(min_tiles);
  TORCH_CHECK(piece_cost >= 0 && piece_cost <= pkv::kMaxPieceCost, "pkv.graph_decode: piece_cost is 0..",
              pkv::kMaxPieceCost, " set-up units in front of a short segment, got ", piece_cost);
  p.piece_cost = static_cast<int>(piece_cost);
  TORCH_CHECK(counter_stride >= 1 && counter_stride <= pkv::kMaxCounterStride && spin_ns >= 0 &&
                  spin_ns <= pkv::kMaxSpinNs,
              "pkv.graph_decode: counter_stride is 1..", pkv::kMaxCounterStride, " and spin_ns 0..", pkv::kMaxSpinNs);
  p.counter_stride = static_cast<int>(counter_stride);
  p.spin_ns = static_cast<int>(spin_ns);
  p.scale_log2 = static_cast<float>(M_LOG2E * sm_scale);
  p.k_scale = static_cast<float>(k_scale);
  p.v_scale = static_cast<float>(v_scale);
  p.window_left = static_cast<int>(window_left);
  p.q_len = static_cast<int>(q_len);
  p.q_block = q_block;
  p.q_blocks = q_blocks;
  TORCH_CHECK(counter_stride * q_blocks <= pkv::kMaxCounterStride, "pkv.graph_decode: counter_stride x query blocks (",
              q_blocks, ") is at most ", pkv::kMaxCounterStride);
  p.sinks = sinks ? sinks->data_ptr<float>() : nullptr;
  TORCH_CHECK(short_tiles >= 0 && short_tiles < (int64_t{1} << 20), "pkv.graph_decode: short_tiles >= 0, got ",
              short_tiles);
  p.short_tiles = static_cast<int>(short_tiles);
  if (page_scales) {
    check_cuda(*page_scales, "page_scales");
    TORCH_CHECK(page_scales->scalar_type() == at::kFloat && page_scales->dim() == 3 &&
                    page_scales->size(0) == k.size(0) && page_scales->size(1) == 2 && page_scales->size(2) == H,
                "pkv.graph_decode: page_scales must be float32 [num_pages, 2, Hkv]");
    TORCH_CHECK(P >= 16, "pkv.graph_decode: page scales need pages of >= 16 tokens");
    p.page_scales = page_scales->data_ptr<float>();
  }
  const cudaError_t err =
      pkv::launch_graph_decode(p, dtype_of(q), fp8, static_cast<int>(D), pdl, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "pkv.graph_decode launch failed: ", cudaGetErrorString(err));
}

// Our layout kv [num_pages, 2, Hkv, P, D], the scale 1/sqrt(D), no cap, no LSE (the pkv-graph engine).
void graph_decode(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table, const at::Tensor& seq_lens,
                  const at::Tensor& req_ids, const at::Tensor& out, const at::Tensor& partial,
                  const at::Tensor& counters, int64_t num_ctas, int64_t min_tiles,
                  const std::optional<at::Tensor>& page_scales, double k_scale, double v_scale, int64_t piece_cost,
                  int64_t counter_stride, int64_t spin_ns, bool pdl, int64_t window_left, int64_t q_len,
                  const std::optional<at::Tensor>& sinks, int64_t short_tiles) {
  check_cuda(kv, "kv");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2, "pkv: kv[pages,2,Hkv,P,D] expected");
  graph_decode_paged(q, kv.select(1, 0), kv.select(1, 1), block_table, seq_lens, req_ids, out, std::nullopt, partial,
                     counters, num_ctas, min_tiles, page_scales, k_scale, v_scale,
                     1.0 / std::sqrt(static_cast<double>(kv.size(4))), 0.0, piece_cost, counter_stride, spin_ns, pdl,
                     window_left, q_len, sinks, short_tiles);
}

int64_t graph_ctas_per_sm(int64_t head_dim) { return pkv::graph_decode_ctas_per_sm(static_cast<int>(head_dim)); }

// PKV_TRACE builds: the phase stamps of the last launch (graph_decode.h), into a CPU int64
// tensor of kTraceRecords x kTraceFields, and cleared on the device.
void graph_trace(const at::Tensor& out) {
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == at::kLong &&
                  out.numel() == static_cast<int64_t>(pkv::kTraceRecords) * pkv::kTraceFields,
              "pkv.graph_trace: a contiguous CPU int64 tensor of ", pkv::kTraceRecords, " x ", pkv::kTraceFields,
              " expected");
  const cudaError_t err = pkv::read_graph_trace(reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()));
  TORCH_CHECK(err == cudaSuccess, "pkv.graph_trace failed: ", cudaGetErrorString(err),
              err == cudaErrorNotSupported ? " (build with PKV_NVCC_FLAGS=-DPKV_TRACE=1)" : "");
}

void read_probe(const at::Tensor& src, const at::Tensor& sink, int64_t blocks) {
  check_cuda(src, "src"); check_cuda(sink, "sink");
  TORCH_CHECK(sink.scalar_type() == at::kInt && sink.numel() >= blocks * pkv::kReadProbeThreads, "pkv.read_probe: sink");
  const at::cuda::CUDAGuard guard(src.device());
  const int64_t bytes = src.numel() * src.element_size();
  const cudaError_t err = pkv::launch_read_probe(src.data_ptr(), bytes, reinterpret_cast<uint32_t*>(sink.data_ptr<int>()),
                                                 static_cast<int>(blocks), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "pkv.read_probe launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY(pkv, m) {
  m.def("decode(Tensor q, Tensor kv, Tensor block_table, Tensor meta, Tensor(a!) out, Tensor(b!) partial, "
        "Tensor(c!) counters, int seq_lens_off, int req_ids_off, int rows_off, int tasks_off, int seg_off, "
        "int num_rows, int splits, int num_slots, int bound_len, int group, int page_shift, bool qo_indexed, "
        "bool early_exit, int mode) -> ()");
  m.def("merge(Tensor partial, Tensor meta, Tensor(a!) out, int seg_off, int rows_off, int num_rows, "
        "int num_kv_heads, int num_slots, int group, int qo_indexed) -> ()");
  m.def("read_probe(Tensor src, Tensor(a!) sink, int blocks) -> ()");
  m.def("graph_decode(Tensor q, Tensor kv, Tensor block_table, Tensor seq_lens, Tensor req_ids, Tensor(a!) out, "
        "Tensor(b!) partial, Tensor(c!) counters, int num_ctas, int min_tiles, Tensor? page_scales=None, "
        "float k_scale=1.0, float v_scale=1.0, int piece_cost=8, int counter_stride=1, int spin_ns=0, "
        "bool pdl=False, int window_left=-1, int q_len=1, Tensor? sinks=None, int short_tiles=0) -> ()");
  m.def("graph_decode_paged(Tensor q, Tensor k, Tensor v, Tensor block_table, Tensor seq_lens, Tensor req_ids, "
        "Tensor(a!) out, Tensor(b!)? lse, Tensor(c!) partial, Tensor(d!) counters, int num_ctas, int min_tiles, "
        "Tensor? page_scales, float k_scale, float v_scale, float sm_scale, float logits_soft_cap, int piece_cost=8, "
        "int counter_stride=1, int spin_ns=0, bool pdl=False, int window_left=-1, int q_len=1, "
        "Tensor? sinks=None, int short_tiles=0) -> ()");
  m.def("graph_ctas_per_sm(int head_dim) -> int", &graph_ctas_per_sm);
  m.def("graph_trace(Tensor(a!) out) -> ()", &graph_trace);
}

TORCH_LIBRARY_IMPL(pkv, CUDA, m) {
  m.impl("decode", &decode);
  m.impl("merge", &merge);
  m.impl("read_probe", &read_probe);
  m.impl("graph_decode", &graph_decode);
  m.impl("graph_decode_paged", &graph_decode_paged);
}
