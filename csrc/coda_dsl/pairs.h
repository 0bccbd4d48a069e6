// Visitor node for half-width outputs of pairwise epilogues (cd.pairs): the value of column pair
// (2j, 2j+1) is stored once, at column j of an [M, N/2] tensor. Pairwise functors keep a half-width
// value in both slots of its pair, so the even column's slot is the one written. Direct predicated
// stores from registers, like CUTLASS's Sm90AuxStore<0>, but addressed through the element
// coordinates because column j = n / 2 is not an affine function of n.
#pragma once

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

namespace coda {

template <class Element>
struct PairStore {
  struct SharedStorage {};
  struct Arguments {
    Element* ptr = nullptr;
    int64_t ld = 0;     // row stride of the [M, N/2] output, in elements
    int64_t batch = 0;  // batch stride
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) { return true; }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE PairStore() {}
  CUTLASS_HOST_DEVICE PairStore(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <class RTensor, class CTensor, class ProblemShapeMNL>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RTensor&& r, CTensor&& c, ProblemShapeMNL shape, Params const* params)
        : tC_rAux(cute::forward<RTensor>(r)), tC_cAux(cute::forward<CTensor>(c)), problem_shape_mnl(shape),
          params_ptr(params) {}

    RTensor tC_rAux;  // this thread's values of the current epilogue subtile
    CTensor tC_cAux;  // their (m, n, l) coordinates, per subtile
    ProblemShapeMNL problem_shape_mnl;
    Params const* params_ptr;

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int, int,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      using Convert = cutlass::NumericArrayConverter<Element, ElementInput, FragmentSize,
                                                     cutlass::FloatRoundStyle::round_to_nearest>;
      cute::Tensor tC_rAux_frg = cute::recast<cutlass::Array<Element, FragmentSize>>(cute::coalesce(tC_rAux));
      tC_rAux_frg(epi_v) = Convert{}(frg_input);
      return frg_input;
    }

    CUTLASS_DEVICE void end_loop(int epi_m, int epi_n) {
      if (params_ptr->ptr == nullptr) return;
      cute::Tensor coords = tC_cAux(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < cute::size(tC_rAux); ++k) {
        auto c = coords(k);
        int n = cute::get<1>(c);
        if ((n & 1) == 0 && cute::elem_less(c, problem_shape_mnl)) {
          params_ptr->ptr[cute::get<2>(c) * params_ptr->batch + cute::get<0>(c) * params_ptr->ld + n / 2] =
              tC_rAux(k);
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto problem_shape_mnl = cute::make_shape(M, N, L);
    cute::Tensor coords = cute::make_identity_tensor(problem_shape_mnl);
    cute::Tensor tC_cAux = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        coords, args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile, args.tiled_copy, args.thread_idx);
    cute::Tensor tC_rAux = cute::make_tensor<Element>(cute::take<0, 3>(cute::shape(tC_cAux)));
    return ConsumerStoreCallbacks<decltype(tC_rAux), decltype(tC_cAux), decltype(problem_shape_mnl)>(
        cute::move(tC_rAux), cute::move(tC_cAux), problem_shape_mnl, params_ptr);
  }
};

}  // namespace coda
