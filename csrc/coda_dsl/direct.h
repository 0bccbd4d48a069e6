// What the custom visitor nodes share: they move values straight between registers and global
// memory, addressed through the (m, n, l) coordinates of each value this thread holds, and need
// no shared memory, workspace or producer-warp work.
#pragma once

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

namespace coda {

// What a consumer-only node without workspace answers to the collective (no producer loads, no C).
struct ConsumerOnlyNode {
  template <class ProblemShape, class Arguments>
  static bool can_implement(ProblemShape const&, Arguments const&) { return true; }
  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }
};

template <class Arguments_>
struct DirectNode : ConsumerOnlyNode {
  struct SharedStorage {};
  using Arguments = Arguments_;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }

  CUTLASS_HOST_DEVICE DirectNode() {}
  CUTLASS_HOST_DEVICE DirectNode(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr = nullptr;
};

// The (m, n, l) coordinates of this thread's values, (CPY, CPY_M, CPY_N, EPI_M, EPI_N) in the
// order visit() sees them, and the problem's (M, N, L) to predicate with.
template <bool ReferenceSrc, class... Args>
CUTLASS_DEVICE auto thread_coordinates(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
  auto [M, N, K, L] = args.problem_shape_mnkl;
  auto shape_mnl = cute::make_shape(M, N, L);
  auto coords = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
      cute::make_identity_tensor(shape_mnl), args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile,
      args.tiled_copy, args.thread_idx);
  return cute::make_tuple(coords, shape_mnl);
}

// Whether this thread's tile lies wholly inside the problem's (M, N): then its values need no bounds checks.
template <class... Args>
CUTLASS_DEVICE bool tile_inside(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
  auto [M, N, K, L] = args.problem_shape_mnkl;
  auto [m, n, k, l] = args.tile_coord_mnkl;
  return (m + 1) * cute::size<0>(args.tile_shape_mnk) <= M && (n + 1) * cute::size<1>(args.tile_shape_mnk) <= N;
}

// Registers with one slot per row of this thread's values, indexed like those values (stride 0
// along n): what a per-row statistic accumulates into.
template <class T, bool ReferenceSrc, class... Args>
CUTLASS_DEVICE auto per_row_registers(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
  auto [M, N, K, L] = args.problem_shape_mnkl;
  auto rows = cute::make_tensor(cute::make_gmem_ptr(static_cast<T*>(nullptr)),  // a layout only: never read
                                cute::make_layout(cute::make_shape(M, N, L), cute::make_stride(cute::_1{}, cute::_0{}, M)));
  return cute::make_tensor_like<T>(cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
      rows, args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile, args.tiled_copy, args.thread_idx));
}

// The coordinates of the distinct slots of `registers` (from per_row_registers): one per row.
template <class Registers, class Coords>
CUTLASS_DEVICE auto row_coordinates(Registers const& registers, Coords const& coords) {
  return cute::make_tensor(coords.data(), cute::make_layout(cute::filter_zeros(registers).shape(), coords.stride()));
}

}  // namespace coda
