// Helpers the generated kernels include: node aliases CUTLASS spells awkwardly, Arguments built
// from torch tensors, and the launch path (no per-call device queries, workspace from torch's allocator).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "coda_dsl/functional.h"

namespace coda {

namespace fusion = cutlass::epilogue::fusion;
namespace detail = cutlass::epilogue::collective::detail;
using RowMajorStride = cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor>;  // (int64, _1, int64)

// A full [M, N] operand read through TMA, staged like C.
template <class EpiDesc, class Element>
struct AuxLoadFor_ {
  using Desc = detail::AuxLoadDescriptor<EpiDesc, cutlass::layout::RowMajor, Element>;
  using type = fusion::Sm90AuxLoad<Desc::Stages, typename EpiDesc::EpilogueTile, Element, RowMajorStride,
                                   typename Desc::SmemLayoutAtom, typename Desc::CopyOpS2R>;
};
template <class EpiDesc, class Element>
using AuxLoadFor = typename AuxLoadFor_<EpiDesc, Element>::type;

// A full [M, N] auxiliary output written through TMA, staged like D.
template <class EpiDesc, class Element>
struct AuxStoreFor_ {
  using Desc = detail::AuxStoreDescriptor<EpiDesc, cutlass::layout::RowMajor, Element>;
  using type = fusion::Sm90AuxStore<Desc::Stages, typename EpiDesc::EpilogueTile, Element,
                                    cutlass::FloatRoundStyle::round_to_nearest, RowMajorStride,
                                    typename Desc::SmemLayoutAtom, typename Desc::CopyOpR2S>;
};
template <class EpiDesc, class Element>
using AuxStoreFor = typename AuxStoreFor_<EpiDesc, Element>::type;

// Batch stride of a 2-D / 3-D operand; unbatched, the span of the matrix (TMA wants a sane one).
inline int64_t batch_stride(at::Tensor const& t) {
  if (t.dim() == 3) return t.stride(0);
  return std::max(t.size(0) * t.stride(0), t.size(1) * t.stride(1));
}

// The element type a node's Arguments pointer field points to.
template <class Ptr>
using pointee_t = std::remove_cv_t<std::remove_pointer_t<Ptr>>;

template <class Node>
typename Node::Arguments aux_load_args(at::Tensor const& t) {
  using E = pointee_t<decltype(typename Node::Arguments{}.ptr_aux)>;
  return {reinterpret_cast<E const*>(t.data_ptr()), E(0), {t.stride(-2), cute::_1{}, batch_stride(t)}};
}

template <class Node>
typename Node::Arguments aux_store_args(at::Tensor const& t) {
  using E = pointee_t<decltype(typename Node::Arguments{}.ptr_aux)>;
  return {reinterpret_cast<E*>(t.data_ptr()), {t.stride(-2), cute::_1{}, batch_stride(t)}};
}

// Vectors: [N] / [M] shared by every batch, or [L, N] / [L, M] one per batch.
template <class Node>
typename Node::Arguments vec_n_args(at::Tensor const& t) {
  using E = pointee_t<decltype(typename Node::Arguments{}.ptr_row)>;
  return {reinterpret_cast<E const*>(t.data_ptr()), E(0), {cute::_0{}, cute::_1{}, t.dim() == 2 ? t.stride(0) : 0}};
}

template <class Node>
typename Node::Arguments vec_m_args(at::Tensor const& t) {
  using E = pointee_t<decltype(typename Node::Arguments{}.ptr_col)>;
  return {reinterpret_cast<E const*>(t.data_ptr()), E(0), {cute::_1{}, cute::_0{}, t.dim() == 2 ? t.stride(0) : 0}};
}

// [M, N/2] operands and outputs of pairwise epilogues (coda::PairLoad / PairStore in pairs.h).
template <class Node>
typename Node::Arguments pair_args(at::Tensor const& t) {
  using Ptr = decltype(typename Node::Arguments{}.ptr);
  return {reinterpret_cast<Ptr>(t.data_ptr()), t.stride(-2), batch_stride(t)};
}

// cd.take (coda::RowTake in rows.h): the int64 column index and the fp32 output, [M] or [L, M].
template <class Node>
typename Node::Arguments take_args(at::Tensor const& index, at::Tensor const& out) {
  return {index.data_ptr<int64_t>(), out.data_ptr<float>(), index.dim() == 2 ? index.stride(0) : 0,
          out.dim() == 2 ? out.stride(0) : 0};
}

// Fill the dynamic modes of a CUTLASS stride (static _0/_1 modes stay as they are).
template <class Stride>
Stride make_stride(int64_t s0, int64_t s1, int64_t s2) {
  Stride s{};
  auto set = [](auto&& mode, int64_t v) {  // static modes come back as temporaries
    if constexpr (std::is_integral_v<std::decay_t<decltype(mode)>>) mode = v;
  };
  set(cute::get<0>(s), s0);
  set(cute::get<1>(s), s1);
  set(cute::get<2>(s), s2);
  return s;
}

// The launch path of a GEMM: argument check, workspace from torch's caching allocator (safe under
// CUDA graph capture), shared-memory attribute set once per device, launch on the current stream.
template <class Gemm, bool ZeroWorkspace = false>
void launch(typename Gemm::Arguments& args, at::Tensor const& like, char const* op_name) {
  using Kernel = typename Gemm::GemmKernel;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(like.get_device()).stream();

  static int sm_count[64] = {};
  int device = like.get_device();
  TORCH_CHECK(device >= 0 && device < 64, op_name, ": unsupported device index ", device);
  if (sm_count[device] == 0) {
    sm_count[device] = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
    int smem = Kernel::SharedStorageSize;
    if (smem >= (48 << 10)) {
      cudaError_t e = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      TORCH_CHECK(e == cudaSuccess, op_name, ": cudaFuncSetAttribute failed: ", cudaGetErrorString(e));
    }
  }
  args.hw_info = cutlass::KernelHardwareInfo{device, sm_count[device]};

  cutlass::Status status = Gemm::can_implement(args);
  TORCH_CHECK(status == cutlass::Status::kSuccess, op_name, ": CUTLASS cannot run this problem (",
              cutlassGetStatusString(status), "); check operand alignment (16 bytes) and shapes");

  size_t ws_size = Gemm::get_workspace_size(args);
  at::Tensor workspace;
  void* ws = nullptr;
  if (ws_size > 0) {
    workspace = at::empty({int64_t(ws_size)}, like.options().dtype(at::kByte));
    ws = workspace.data_ptr();
  }
  if constexpr (ZeroWorkspace) {
    // Stream-K's tile flags must start at zero. Zeroing the whole workspace (flags and partials) with the
    // runtime API, rather than Kernel::initialize_workspace, keeps the epilogue's own workspace set-up
    // (driver-API fills for reductions, which coda does itself) out of the binary.
    if (ws_size > 0) {
      cudaError_t e = cudaMemsetAsync(ws, 0, ws_size, stream);
      TORCH_CHECK(e == cudaSuccess, op_name, ": workspace memset failed: ", cudaGetErrorString(e));
    }
  }
  auto params = Kernel::to_underlying_arguments(args, ws);
  status = Gemm::run(params, stream);
  TORCH_CHECK(status == cutlass::Status::kSuccess, op_name, ": kernel launch failed (",
              cutlassGetStatusString(status), "): ", cudaGetErrorString(cudaGetLastError()));
}

}  // namespace coda
