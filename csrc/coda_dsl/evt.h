// Helpers the generated kernels include: node aliases CUTLASS spells awkwardly, Arguments built
// from the caller's tensors (abi.h), and the launch path (no per-call device queries; the workspace
// comes from the caller, who allocates it with torch's caching allocator).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/device_kernel.h"  // CUTLASS_GRID_CONSTANT
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
// Hopper's mainloop, its builder and kernels alone: CUTLASS's umbrella headers (gemm/collective/
// collective_builder.hpp, gemm/kernel/gemm_universal.hpp, gemm/device/gemm_universal_adapter.h) would
// parse every collective and kernel from sm70 to sm120, and CUTLASS 2.x's device layer.
#include "cutlass/gemm/collective/collective_mma_decl.hpp"
#include "cutlass/gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder_decl.hpp"
#include "cutlass/gemm/collective/builders/sm90_gmma_builder.inl"
#include "cutlass/gemm/kernel/gemm_universal_decl.h"
#include "cutlass/gemm/kernel/sm90_gemm_tma_warpspecialized_cooperative.hpp"
#include "cutlass/gemm/kernel/sm90_gemm_tma_warpspecialized_pingpong.hpp"

#include "coda_dsl/abi.h"
#include "coda_dsl/device.h"
#include "coda_dsl/functional.h"
#include "coda_dsl/schedule.h"

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

// A [M, 2N] operand / output of 16-bit values, moved as [M, N] 32-bit words (pairs.h: Unpack, Pack).
// The words travel as float bit patterns: the topological visitor converts every node's output to
// float numerically, which keeps a float's bits and would round a uint32_t's.
template <class EpiDesc>
using WideLoad = AuxLoadFor<EpiDesc, float>;
template <class EpiDesc>
using WideStore = AuxStoreFor<EpiDesc, float>;

// Batch stride of a 2-D / 3-D operand; unbatched, the span of the matrix (TMA wants a sane one).
inline int64_t batch_stride(TensorRef const& t) {
  if (t.dim() == 3) return t.stride(0);
  return std::max(t.size(0) * t.stride(0), t.size(1) * t.stride(1));
}

// The element type a node's Arguments pointer field points to.
template <class Ptr>
using pointee_t = std::remove_cv_t<std::remove_pointer_t<Ptr>>;

template <class Node>
typename Node::Arguments aux_load_args(TensorRef const& t) {
  using E = pointee_t<decltype(typename Node::Arguments{}.ptr_aux)>;
  return {reinterpret_cast<E const*>(t.data_ptr()), E(0), {t.stride(-2), cute::_1{}, batch_stride(t)}};
}

template <class Node>
typename Node::Arguments aux_store_args(TensorRef const& t) {
  using E = pointee_t<decltype(typename Node::Arguments{}.ptr_aux)>;
  return {reinterpret_cast<E*>(t.data_ptr()), {t.stride(-2), cute::_1{}, batch_stride(t)}};
}

// WideLoad / WideStore: the 16-bit tensor's strides in words (the runtime passes 16-byte aligned rows).
template <class Node>
typename Node::Arguments wide_args(TensorRef const& t) {
  using E = pointee_t<decltype(typename Node::Arguments{}.ptr_aux)>;
  RowMajorStride words{t.stride(-2) / 2, cute::_1{}, batch_stride(t) / 2};
  if constexpr (std::is_const_v<std::remove_pointer_t<decltype(typename Node::Arguments{}.ptr_aux)>>)
    return {reinterpret_cast<E const*>(t.data_ptr()), E(0), words};
  else
    return {reinterpret_cast<E*>(t.data_ptr()), words};
}

// Vectors: [N] / [M] shared by every batch, or [L, N] / [L, M] one per batch.
template <class Node>
typename Node::Arguments vec_n_args(TensorRef const& t) {
  using E = pointee_t<decltype(typename Node::Arguments{}.ptr_row)>;
  return {reinterpret_cast<E const*>(t.data_ptr()), E(0), {cute::_0{}, cute::_1{}, t.dim() == 2 ? t.stride(0) : 0}};
}

template <class Node>
typename Node::Arguments vec_m_args(TensorRef const& t) {
  using E = pointee_t<decltype(typename Node::Arguments{}.ptr_col)>;
  return {reinterpret_cast<E const*>(t.data_ptr()), E(0), {cute::_1{}, cute::_0{}, t.dim() == 2 ? t.stride(0) : 0}};
}

// [M, N/2] operands and outputs of pairwise epilogues (coda::PairLoad / PairStore in pairs.h).
template <class Node>
typename Node::Arguments pair_args(TensorRef const& t) {
  using Ptr = decltype(typename Node::Arguments{}.ptr);
  return {reinterpret_cast<Ptr>(t.data_ptr()), t.stride(-2), batch_stride(t)};
}

// cd.take (coda::RowTake in rows.h): the int64 column index and the fp32 output, [M] or [L, M].
template <class Node>
typename Node::Arguments take_args(TensorRef const& index, TensorRef const& out) {
  return {index.data_ptr<int64_t>(), out.data_ptr<float>(), index.dim() == 2 ? index.stride(0) : 0,
          out.dim() == 2 ? out.stride(0) : 0};
}

// cd.take's derivative (coda::RowOneHot in rows.h): the int64 column index, [M] or [L, M].
template <class Node>
typename Node::Arguments one_hot_args(TensorRef const& index) {
  return {index.data_ptr<int64_t>(), index.dim() == 2 ? index.stride(0) : 0};
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

}  // namespace coda

// The fatbinary of the library's GEMM kernel (compiled by the build's device pass): the build
// assembles it into the library as a hidden symbol, so each library sees its own.
extern "C" __attribute__((visibility("hidden"))) unsigned char const coda_fatbin[];

namespace coda {

// A library's GEMM kernel and what is set up for it once: the kernel loaded from the library's fatbinary
// (a CUDA library serves every device; CUDA's lazy loading brings the kernel to a device at its first
// launch there), and per device the SM count, with the kernel's shared-memory attribute set first. The
// generated file keeps one: not statics here, since a static in a function template is one object in the
// whole process (GNU unique), shared by every library whose GEMM has the same type (configs that differ
// only in raster order or swizzle).
class GemmEntry {
 public:
  GemmEntry(void const* fatbin, char const* name) : fatbin_(fatbin), name_(name) {}

  // The kernel's handle; a load that failed is tried again at the next call.
  cudaKernel_t kernel(char const* op_name) {
    cudaKernel_t k = kernel_.load(std::memory_order_acquire);
    if (k) return k;
    std::lock_guard<std::mutex> lock(mutex_);
    k = kernel_.load(std::memory_order_relaxed);
    if (!k) {
      if (!library_)
        check_cuda(cudaLibraryLoadData(&library_, fatbin_, nullptr, nullptr, 0, nullptr, nullptr, 0), op_name,
                   "loading the GEMM kernel's library");
      check_cuda(cudaLibraryGetKernel(&k, library_, name_), op_name, "finding the GEMM kernel");
      kernel_.store(k, std::memory_order_release);
    }
    return k;
  }

  // The SM count of `device`, where the kernel may use `smem` bytes of dynamic shared memory.
  int sm_count(int device, int smem, char const* op_name) {
    if (device < 0 || device >= kDevices) fail(op_name, ": unsupported device index ", std::to_string(device));
    int n = sm_count_[device].load(std::memory_order_acquire);
    if (n == 0) {  // recorded last: a set-up that failed runs again at the next call (threads racing here
                   // set the same attribute and store the same count)
      n = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
      if (smem >= (48 << 10)) {
        check_cuda(cudaKernelSetAttributeForDevice(kernel(op_name), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   smem, device), op_name, "cudaKernelSetAttributeForDevice");
      }
      sm_count_[device].store(n, std::memory_order_release);
    }
    return n;
  }

 private:
  static constexpr int kDevices = 64;
  void const* fatbin_;
  char const* name_;
  std::mutex mutex_;
  cudaLibrary_t library_ = nullptr;
  std::atomic<cudaKernel_t> kernel_{nullptr};
  std::atomic<int> sm_count_[kDevices] = {};
};

// Before a GEMM's launch, in a size query too: the device set up (GemmEntry::sm_count), the problem
// checked (CUTLASS's can_implement, with a clear message), the workspace size.
template <class Kernel>
size_t prepare(typename Kernel::Arguments& args, Call const& call, char const* op_name, GemmEntry& entry) {
  args.hw_info = cutlass::KernelHardwareInfo{call.device, entry.sm_count(call.device, Kernel::SharedStorageSize,
                                                                         op_name)};
  if (!Kernel::can_implement(args))  // what GemmUniversalAdapter::can_implement asks (a yes or no)
    fail(op_name, ": CUTLASS cannot run this problem; check operand alignment (16 bytes) and shapes");
  return Kernel::get_workspace_size(args);  // the adapter's, less its split-K-parallel mode (not used)
}

// The launch of a prepared GEMM on the caller's stream, with its workspace (`ws_size` bytes at `ws`).
template <class Kernel, bool ZeroWorkspace = false>
void launch(typename Kernel::Arguments& args, GemmEntry& entry, void* ws, size_t ws_size, Call const& call,
            char const* op_name) {
  if constexpr (ZeroWorkspace) {
    // Stream-K's tile flags must start at zero. Zeroing the whole workspace (flags and partials) with the
    // runtime API, rather than Kernel::initialize_workspace, keeps the epilogue's own workspace set-up
    // (driver-API fills for reductions, which coda does itself) out of the binary.
    if (ws_size > 0) check_cuda(cudaMemsetAsync(ws, 0, ws_size, call.stream), op_name, "workspace memset");
  }
  auto params = Kernel::to_underlying_arguments(args, ws);
  // The launch GemmUniversalAdapter::run makes, less its per-launch cudaFuncSetAttribute (non-portable
  // cluster sizes: ours have at most 4 CTAs, portable): one cudaLaunchKernelExC.
  using Cluster = typename Kernel::DispatchPolicy::ClusterShape;
  static_assert(cute::size(Cluster{}) <= 8, "a cluster of more than 8 CTAs needs cudaFuncAttributeNonPortableClusterSizeAllowed");
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim = {unsigned(cute::size<0>(Cluster{})), unsigned(cute::size<1>(Cluster{})),
                            unsigned(cute::size<2>(Cluster{}))};
  cudaLaunchConfig_t config{};
  config.gridDim = Kernel::get_grid_shape(params);
  config.blockDim = Kernel::get_block_shape();
  config.dynamicSmemBytes = Kernel::SharedStorageSize;
  config.stream = call.stream;
  config.attrs = &cluster;
  config.numAttrs = cute::size(Cluster{}) > 1 ? 1 : 0;  // a 1x1x1 cluster launches as a plain grid, as in CUTLASS
  void* kernel_params[] = {&params};
  cudaError_t launched = cudaLaunchKernelExC(&config, reinterpret_cast<void const*>(entry.kernel(op_name)),
                                             kernel_params);
  if (launched != cudaSuccess) (void)cudaGetLastError();  // reported here, not again by the next check
  check_cuda(launched, op_name, "kernel launch");
}

}  // namespace coda
