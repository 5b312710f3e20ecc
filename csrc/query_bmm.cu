// safe_mla_query_bmm: out[h] = query[h] @ weight[h], the MLA decode query absorption.
//
// Why it exists: on SM120/121, cuBLAS batched BF16 GEMM can read up to ~64 KiB past the base of
// strided operands (Xid 31, illegal address), also under CUDA-graph capture. The usual fix, a
// contiguous copy of the query, costs a copy on the decode hot path. This kernel reads the views
// in place and never touches a byte outside them: every global load and store is bounds-checked
// against (T, Q, L) and addressed through the views' own strides.
//
// Contract: bf16 operands, fp32 accumulation on tensor cores (sm_80+), result rounded to bf16
// (nearest even). Only the last dim of each operand needs stride 1; other strides are arbitrary.
//
// Built against PyTorch's stable ABI only (TORCH_TARGET_VERSION 2.13, or 2.10 when built against
// an older torch, as GPU images may carry): no ATen / c10 headers, so one binary serves every
// torch from its target on.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <climits>
#include <cstdint>
#include <string>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "safe_mla_query_bmm needs sm_80+ (bf16 tensor cores, cp.async); drop older archs"
#endif

namespace vllm_mla {
namespace {

namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;
using torch::stable::Tensor;

// Tiling: one block = (head, up to BM rows of T, kBN columns of L). Decode is bound by streaming
// the weight, so kBN = 64 gives L = 512 eight blocks per head (enough blocks even for T = 1), and
// K (= Q) streams through a kStages-deep cp.async ring of kBK-row chunks, keeping three chunks
// (96 weight rows) in flight ahead of the math. Each of the 4 warps owns 16 output columns.
constexpr int kBN = 64;
constexpr int kBK = 32;
constexpr int kStages = 4;
constexpr int kWarps = kBN / 16;
constexpr int kThreads = kWarps * 32;
constexpr int kVec = 8;  // bf16 per 16-byte vector
// +8 bf16 per smem row keeps rows 16-B aligned for cp.async and staggers banks for wmma loads.
constexpr int kLdA = kBK + 8;
constexpr int kLdB = kBN + 8;
constexpr int kLdC = kBN + 4;  // fp32 epilogue staging

// kMF = 16-row fragments per block (1, 2 or 4): small T wastes no smem or tensor-core work.
template <int kMF>
struct Tile {
  static constexpr int kBM = 16 * kMF;
  static constexpr int kAElems = kBM * kLdA;
  static constexpr int kBElems = kBK * kLdB;
  static constexpr int kStageBytes = (kAElems + kBElems) * int(sizeof(bf16));
  static constexpr int kPipeBytes = kStages * kStageBytes;
  static constexpr int kCBytes = kBM * kLdC * int(sizeof(float));
  static constexpr int kSmemBytes = kPipeBytes > kCBytes ? kPipeBytes : kCBytes;
  // wmma needs 32-B aligned fragment pointers; every stage and B slice starts on one.
  static_assert(kStageBytes % 32 == 0 && (kAElems * sizeof(bf16)) % 32 == 0, "smem alignment");
  static_assert(kSmemBytes <= 48 * 1024, "static shared memory limit");
};

struct Params {
  const bf16* query;
  const bf16* weight;
  bf16* out;
  int T, Q, L;
  int64_t q_sh, q_st;  // query strides (head, row); the column stride is 1
  int64_t w_sh, w_sq;  // weight strides (head, k)
  int64_t o_sh, o_st;  // out strides (head, row)
};

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  // .cg: the weight is streamed once, no point polluting L1 with it.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Stages elements [col, col + 8) of row `row` of a row-major view (row stride `ld`, column
// stride 1, `rows` x `cols` valid) into smem. Anything outside the view becomes zero WITHOUT a
// global access; a ragged tail or a view that is not 16-B aligned is read element by element.
__device__ __forceinline__ void load_vec(bf16* dst, const bf16* base, int64_t ld, int row,
                                         int col, int rows, int cols) {
  if (row >= rows || col >= cols) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  const bf16* src = base + row * ld + col;
  if (col + kVec <= cols && aligned16(src)) {
    cp_async_16(dst, src);
    return;
  }
  const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
  unsigned short* d = reinterpret_cast<unsigned short*>(dst);
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    unsigned short v = 0;
    if (col + i < cols) v = s[i];
    d[i] = v;
  }
}

// One pipeline stage: query[h, m0 + r, k0 + c] (r < rows) and weight[h, k0 + r, n0 + c] (c < cols).
// a_base / b_base point at query[h, m0, 0] / weight[h, 0, n0]; k0 < Q, so a_base + k0 and
// b_base + k0 * w_sq are elements of the views.
template <int kMF>
__device__ __forceinline__ void load_stage(bf16* As, bf16* Bs, const Params& p,
                                           const bf16* a_base, const bf16* b_base, int k0,
                                           int rows, int cols, int tid) {
  const int k_left = p.Q - k0;
  constexpr int kAPerRow = kBK / kVec;
  for (int v = tid; v < Tile<kMF>::kBM * kAPerRow; v += kThreads) {
    const int r = v / kAPerRow, c = (v % kAPerRow) * kVec;
    load_vec(As + r * kLdA + c, a_base + k0, p.q_st, r, c, rows, k_left);
  }
  constexpr int kBPerRow = kBN / kVec;
  for (int v = tid; v < kBK * kBPerRow; v += kThreads) {
    const int r = v / kBPerRow, c = (v % kBPerRow) * kVec;
    load_vec(Bs + r * kLdB + c, b_base + k0 * p.w_sq, p.w_sq, r, c, k_left, cols);
  }
}

template <int kMF>
__global__ void __launch_bounds__(kThreads) query_bmm_kernel(const Params p) {
  using Tl = Tile<kMF>;
  __shared__ __align__(128) unsigned char smem[Tl::kSmemBytes];

  const int n0 = blockIdx.x * kBN;
  const int m0 = blockIdx.y * Tl::kBM;
  const int h = blockIdx.z;
  const int rows = min(Tl::kBM, p.T - m0);  // valid T rows in this block (>= 1)
  const int cols = min(kBN, p.L - n0);      // valid L columns in this block (>= 1)
  const int tid = threadIdx.x;
  const int warp = tid / 32;

  const bf16* a_base = p.query + h * p.q_sh + m0 * p.q_st;
  const bf16* b_base = p.weight + h * p.w_sh + n0;
  auto stage_a = [&](int s) { return reinterpret_cast<bf16*>(smem + s * Tl::kStageBytes); };
  auto stage_b = [&](int s) { return stage_a(s) + Tl::kAElems; };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMF];
#pragma unroll
  for (int mf = 0; mf < kMF; ++mf) wmma::fill_fragment(acc[mf], 0.0f);

  const int nk = (p.Q + kBK - 1) / kBK;
  // Prologue: the first kStages - 1 chunks in flight. One commit per slot, even when empty, so
  // that wait_group<kStages - 2> below always means "chunk kc has landed".
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) {
      load_stage<kMF>(stage_a(s), stage_b(s), p, a_base, b_base, s * kBK, rows, cols, tid);
    }
    cp_async_commit();
  }

  for (int kc = 0; kc < nk; ++kc) {
    cp_async_wait<kStages - 2>();
    // Makes every thread's chunk kc visible, and guarantees nobody still reads the slot of chunk
    // kc - 1, which is refilled next.
    __syncthreads();
    const int next = kc + kStages - 1;
    if (next < nk) {
      const int s = next % kStages;
      load_stage<kMF>(stage_a(s), stage_b(s), p, a_base, b_base, next * kBK, rows, cols, tid);
    }
    cp_async_commit();

    const bf16* As = stage_a(kc % kStages);
    const bf16* Bs = stage_b(kc % kStages);
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
      wmma::load_matrix_sync(b, Bs + kk * kLdB + warp * 16, kLdB);
#pragma unroll
      for (int mf = 0; mf < kMF; ++mf) {
        if (mf * 16 < rows) {  // block-uniform: skip fragments that are all zero padding
          wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
          wmma::load_matrix_sync(a, As + mf * 16 * kLdA + kk, kLdA);
          wmma::mma_sync(acc[mf], a, b, acc[mf]);
        }
      }
    }
  }

  cp_async_wait<0>();
  __syncthreads();  // the fp32 staging below reuses the pipeline's smem
  float* Cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int mf = 0; mf < kMF; ++mf) {
    wmma::store_matrix_sync(Cs + mf * 16 * kLdC + warp * 16, acc[mf], kLdC, wmma::mem_row_major);
  }
  __syncthreads();

  // Epilogue: round to bf16 and write only elements inside out's view.
  bf16* o_base = p.out + h * p.o_sh + m0 * p.o_st + n0;
  constexpr int kOPerRow = kBN / kVec;
  for (int v = tid; v < Tl::kBM * kOPerRow; v += kThreads) {
    const int r = v / kOPerRow, c = (v % kOPerRow) * kVec;
    if (r >= rows || c >= cols) continue;
    const float* src = Cs + r * kLdC + c;
    bf16* dst = o_base + r * p.o_st + c;
    if (c + kVec <= cols && aligned16(dst)) {
      uint4 packed;
      unsigned short* u = reinterpret_cast<unsigned short*>(&packed);
#pragma unroll
      for (int i = 0; i < kVec; ++i) u[i] = __bfloat16_as_ushort(__float2bfloat16_rn(src[i]));
      *reinterpret_cast<uint4*>(dst) = packed;
    } else {
      for (int i = 0; i < kVec && c + i < cols; ++i) dst[i] = __float2bfloat16_rn(src[i]);
    }
  }
}

std::string shape_of(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

template <int kMF>
void launch(const Params& p, int64_t H, cudaStream_t stream) {
  const int64_t m_tiles = (p.T + Tile<kMF>::kBM - 1) / Tile<kMF>::kBM;
  STD_TORCH_CHECK(H <= 65535 && m_tiles <= 65535, "safe_mla_query_bmm: grid too large (H=", H,
                  ", T=", p.T, ")");
  const dim3 grid((p.L + kBN - 1) / kBN, static_cast<unsigned>(m_tiles),
                  static_cast<unsigned>(H));
  query_bmm_kernel<kMF><<<grid, kThreads, 0, stream>>>(p);
}

}  // namespace

void safe_mla_query_bmm(Tensor query, Tensor weight, Tensor out) {
  const Tensor* operands[] = {&query, &weight, &out};
  const char* names[] = {"query", "weight", "out"};
  for (int i = 0; i < 3; ++i) {
    const Tensor& t = *operands[i];
    STD_TORCH_CHECK(t.scalar_type() == torch::headeronly::ScalarType::BFloat16,
                    "safe_mla_query_bmm: ", names[i], " must be bfloat16");
    STD_TORCH_CHECK(t.dim() == 3, "safe_mla_query_bmm: ", names[i], " must be 3-D, got ",
                    shape_of(t));
    // Size-1 last dims are only ever read at index 0, so their stride does not matter.
    STD_TORCH_CHECK(t.size(2) <= 1 || t.stride(2) == 1, "safe_mla_query_bmm: ", names[i],
                    "'s last dim must have stride 1, got ", t.stride(2));
    STD_TORCH_CHECK(t.is_cuda() && t.get_device_index() == query.get_device_index(),
                    "safe_mla_query_bmm: ", names[i], " must be on query's CUDA device");
  }
  const int64_t H = query.size(0), T = query.size(1), Q = query.size(2), L = weight.size(2);
  STD_TORCH_CHECK(weight.size(0) == H && weight.size(1) == Q && out.size(0) == H &&
                      out.size(1) == T && out.size(2) == L,
                  "safe_mla_query_bmm: expected query [H, T, Q] x weight [H, Q, L] -> out "
                  "[H, T, L], got query ",
                  shape_of(query), ", weight ", shape_of(weight), ", out ", shape_of(out));
  STD_TORCH_CHECK(T < INT_MAX && Q < INT_MAX && L < INT_MAX, "safe_mla_query_bmm: dims too large");
  if (H == 0 || T == 0 || L == 0) return;

  const int32_t device = query.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
// torch < 2.13's headers do not define TORCH_VERSION_2_13_0 (an undefined macro reads as 0 in
// #if, which would pick the 2.13 branch): test that it exists first.
#if defined(TORCH_VERSION_2_13_0) && TORCH_FEATURE_VERSION >= TORCH_VERSION_2_13_0
  const auto stream = static_cast<cudaStream_t>(
      torch::stable::accelerator::getCurrentStream(device).nativeHandle());
#else
  // Before 2.13 the stable accelerator API has no nativeHandle(); the CUDA shim call does it.
  void* raw_stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(device, &raw_stream) == AOTI_TORCH_SUCCESS,
                  "safe_mla_query_bmm: cannot get the current CUDA stream");
  const auto stream = static_cast<cudaStream_t>(raw_stream);
#endif

  Params p;
  p.query = static_cast<const bf16*>(query.data_ptr());
  p.weight = static_cast<const bf16*>(weight.data_ptr());
  p.out = static_cast<bf16*>(out.data_ptr());
  p.T = static_cast<int>(T);
  p.Q = static_cast<int>(Q);
  p.L = static_cast<int>(L);
  p.q_sh = query.stride(0);
  p.q_st = query.stride(1);
  p.w_sh = weight.stride(0);
  p.w_sq = weight.stride(1);
  p.o_sh = out.stride(0);
  p.o_st = out.stride(1);

  if (T <= 16) {
    launch<1>(p, H, stream);
  } else if (T <= 32) {
    launch<2>(p, H, stream);
  } else {
    launch<4>(p, H, stream);
  }
  const cudaError_t err = cudaGetLastError();
  STD_TORCH_CHECK(err == cudaSuccess, "safe_mla_query_bmm: kernel launch failed: ",
                  cudaGetErrorString(err));
}

}  // namespace vllm_mla

STABLE_TORCH_LIBRARY_FRAGMENT(vllm_mla, m) {
#if defined(TORCH_VERSION_2_13_0) && TORCH_FEATURE_VERSION >= TORCH_VERSION_2_13_0
  // The fake (meta) impl is registered from this Python module; torch checks the name.
  m.set_python_module("vllm_mla.ops.query_bmm.custom_op");
#endif
  m.def("safe_mla_query_bmm(Tensor query, Tensor weight, Tensor(a!) out) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(vllm_mla, CUDA, m) {
  m.impl("safe_mla_query_bmm", TORCH_BOX(&vllm_mla::safe_mla_query_bmm));
}
