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

// The consumer callbacks of a tap, a node that observes the values it is given: visit() passes each fragment
// to Derived::accumulate<Checked> and returns it unchanged. Derived::inside (uniform per tile): the tile lies
// wholly inside (M, N), so no value needs its bounds check.
template <class Derived>
struct TapCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
  template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
  CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
                            cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
    auto& self = static_cast<Derived&>(*this);
    if (self.inside) self.template accumulate<false>(frg_input, epi_v, epi_m, epi_n);
    else self.template accumulate<true>(frg_input, epi_v, epi_m, epi_n);
    return frg_input;
  }
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

// Registers with one slot per row (PerRow: a statistic over n) or per column of this thread's values,
// indexed like those values (stride 0 along the reduced axis): what a statistic accumulates into.
template <class T, bool ReferenceSrc, bool PerRow, class... Args>
CUTLASS_DEVICE auto statistic_registers(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
  auto [M, N, K, L] = args.problem_shape_mnkl;
  auto stride = [&] {
    if constexpr (PerRow) return cute::make_stride(cute::_1{}, cute::_0{}, M);
    else return cute::make_stride(cute::_0{}, cute::_1{}, N);
  }();
  auto slots = cute::make_tensor(cute::make_gmem_ptr(static_cast<T*>(nullptr)),  // a layout only: never read
                                 cute::make_layout(cute::make_shape(M, N, L), stride));
  return cute::make_tensor_like<T>(cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
      slots, args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile, args.tiled_copy, args.thread_idx));
}

// The coordinates of the distinct slots of `registers` (from statistic_registers): for each, those of this
// thread's first value in its row or column.
template <class Registers, class Coords>
CUTLASS_DEVICE auto slot_coordinates(Registers const& registers, Coords const& coords) {
  return cute::make_tensor(coords.data(), cute::make_layout(cute::filter_zeros(registers).shape(), coords.stride()));
}

// Which lanes of a warp hold the values of a tile's (m, n): the layout (lane along m, lane along n) -> lane
// index, and this lane's (m, n) position in it, from the epilogue's thread-value layout. RowInOneWarp: assert
// that the values of a tile row lie in one warp (what shuffles alone combine, and a warp's row of partials holds).
template <bool ReferenceSrc, bool RowInOneWarp, class... Args>
CUTLASS_DEVICE auto warp_lanes(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
  using namespace cute;
  auto tile_mn = shape(typename decltype(args.tiled_copy)::Tiler_MN{});
  auto ref_layout = [&] {  // tile (m, n) -> thread-value index
    if constexpr (ReferenceSrc) return right_inverse(args.tiled_copy.get_layoutS_TV()).with_shape(tile_mn);
    else return right_inverse(args.tiled_copy.get_layoutD_TV()).with_shape(tile_mn);
  }();
  using Warps = Int<decltype(args.tiled_copy)::TiledNumThr::value / 32>;
  auto to_lane = composition(Layout<Shape<_32, Warps, _1>, Stride<_1, _0, _0>>{}, ref_layout);
  if constexpr (RowInOneWarp) {
    auto to_warp = composition(Layout<Shape<_32, Warps, _1>, Stride<_0, _1, _0>>{}, ref_layout);
    static_assert(decltype(size(filter(get<1>(to_warp))))::value == 1,
                  "a per-row statistic needs the values of a tile row in one warp (every coda_dsl tile has that)");
  }
  auto lanes = make_layout(filter(get<0>(to_lane)), filter(get<1>(to_lane)));
  auto lane_mn = idx2crd(right_inverse(lanes)(cutlass::canonical_lane_idx()), lanes.shape());
  return make_tuple(lanes, int(get<0>(lane_mn)), int(get<1>(lane_mn)));
}

}  // namespace coda
