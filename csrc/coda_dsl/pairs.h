// Visitor nodes for half-width operands and outputs of pairwise epilogues (cd.pairs): column pair
// (2j, 2j+1) of the tile corresponds to column j of an [M, N/2] tensor. Pairwise functors keep a
// half-width value in both slots of its pair: PairLoad fills both, PairStore writes the even one.
// Direct predicated accesses from registers, like CUTLASS's Sm90AuxLoad<0> / Sm90AuxStore<0>, but
// addressed through the element coordinates, since j = n / 2 is not an affine function of n.
#pragma once

#include "coda_dsl/direct.h"

namespace coda {

template <class Pointer>
struct PairArguments {
  Pointer ptr = nullptr;
  int64_t ld = 0;     // row stride of the [M, N/2] tensor, in elements
  int64_t batch = 0;  // batch stride
};

// What both nodes share: an [M, N/2] (or [L, M, N/2]) tensor and registers for this thread's values.
template <class Pointer>
struct PairNode : DirectNode<PairArguments<Pointer>> {
  using Base = DirectNode<PairArguments<Pointer>>;
  using Base::Base;

  // A derived node's callbacks over this thread's values: their (m, n, l) coordinates per epilogue
  // subtile, registers for them, and the problem's (M, N, L) for predication.
  template <template <class, class, class> class Callbacks, class Element, bool ReferenceSrc, class Node,
            class... Args>
  CUTLASS_DEVICE static auto callbacks(Node const* node,
                                       cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto [tC_cAux, problem_shape_mnl] = thread_coordinates<ReferenceSrc>(args);
    cute::Tensor tC_rAux = cute::make_tensor<Element>(cute::take<0, 3>(cute::shape(tC_cAux)));
    return Callbacks<decltype(tC_rAux), decltype(tC_cAux), decltype(problem_shape_mnl)>(
        cute::move(tC_rAux), cute::move(tC_cAux), problem_shape_mnl, node);
  }

  template <class Coord>
  CUTLASS_DEVICE int64_t offset(Coord const& c) const {
    return cute::get<2>(c) * this->params_ptr->batch + cute::get<0>(c) * this->params_ptr->ld + cute::get<1>(c) / 2;
  }
};

template <class Element>
struct PairLoad : PairNode<Element const*> {
  using Base = PairNode<Element const*>;
  using Base::Base;

  template <class RTensor, class CTensor, class ProblemShapeMNL>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RTensor&& r, CTensor&& c, ProblemShapeMNL shape, PairLoad const* node)
        : tC_rAux(cute::forward<RTensor>(r)), tC_cAux(cute::forward<CTensor>(c)), problem_shape_mnl(shape),
          node(node) {}

    RTensor tC_rAux;
    CTensor tC_cAux;
    ProblemShapeMNL problem_shape_mnl;
    PairLoad const* node;

    CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
      cute::Tensor coords = tC_cAux(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < cute::size(tC_rAux); ++k) {
        auto c = coords(k);
        tC_rAux(k) = cute::elem_less(c, problem_shape_mnl) ? node->params_ptr->ptr[node->offset(c)] : Element(0);
      }
    }

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<Element, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int, int) {
      return cute::recast<cutlass::Array<Element, FragmentSize>>(cute::coalesce(tC_rAux))(epi_v);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    return Base::template callbacks<ConsumerStoreCallbacks, Element, ReferenceSrc>(this, args);
  }
};

template <class Element>
struct PairStore : PairNode<Element*> {
  using Base = PairNode<Element*>;
  using Base::Base;

  template <class RTensor, class CTensor, class ProblemShapeMNL>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RTensor&& r, CTensor&& c, ProblemShapeMNL shape, PairStore const* node)
        : tC_rAux(cute::forward<RTensor>(r)), tC_cAux(cute::forward<CTensor>(c)), problem_shape_mnl(shape),
          node(node) {}

    RTensor tC_rAux;  // this thread's values of the current epilogue subtile
    CTensor tC_cAux;  // their (m, n, l) coordinates, per subtile
    ProblemShapeMNL problem_shape_mnl;
    PairStore const* node;

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
      cute::Tensor coords = tC_cAux(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < cute::size(tC_rAux); ++k) {
        auto c = coords(k);
        if ((cute::get<1>(c) & 1) == 0 && cute::elem_less(c, problem_shape_mnl)) {
          node->params_ptr->ptr[node->offset(c)] = tC_rAux(k);
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    return Base::template callbacks<ConsumerStoreCallbacks, Element, ReferenceSrc>(this, args);
  }
};

}  // namespace coda
