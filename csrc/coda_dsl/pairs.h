// Visitor nodes for operands and outputs whose columns are not the tile's (pairwise epilogues):
//   half width, [M, N/2] (cd.pairs of the accumulator): column pair (2j, 2j+1) of the tile <-> column j.
//     Pairwise functors keep a half-width value in both slots of its pair: PairLoad fills both,
//     PairStore writes the even one. PairLoad reads straight into registers, like CUTLASS's
//     Sm90AuxLoad<0>, addressed through the element coordinates (n / 2 is not what a TMA box of the tile
//     addresses); PairStore stages through shared memory and goes out with TMA.
//   double width, [M, 2N] of 16-bit values (a backward's interleaved pre-activation): the same bytes as
//     an [M, N] tensor of 32-bit words, word n holding columns 2n (low half) and 2n + 1 (high half). So
//     CUTLASS's own TMA aux nodes move the words, staged like C and D (WideLoad, WideStore: evt.h), and
//     Unpack / Pack convert between a word and its two halves.
#pragma once

#include <utility>

#include "coda_dsl/direct.h"

namespace coda {

template <class Pointer>
struct PairArguments {
  Pointer ptr = nullptr;
  int64_t ld = 0;     // row stride of the tensor, in elements
  int64_t batch = 0;  // batch stride
};

// Where the value for tile coordinate c = (m, n, l) lives: column n / 2.
template <class Pointer, class Coord>
CUTLASS_DEVICE int64_t pair_offset(PairArguments<Pointer> const& a, Coord const& c) {
  return cute::get<2>(c) * a.batch + cute::get<0>(c) * a.ld + cute::get<1>(c) / 2;
}

template <class Element>
struct PairLoad : DirectNode<PairArguments<Element const*>> {
  using Base = DirectNode<PairArguments<Element const*>>;
  using Base::Base;

  template <class RTensor, class CTensor, class ProblemShapeMNL>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RTensor&& r, CTensor&& c, ProblemShapeMNL shape, PairLoad const* node)
        : tC_rAux(cute::forward<RTensor>(r)), tC_cAux(cute::forward<CTensor>(c)), problem_shape_mnl(shape),
          node(node) {}

    RTensor tC_rAux;  // this thread's values of the current epilogue subtile
    CTensor tC_cAux;  // their (m, n, l) coordinates, per subtile
    ProblemShapeMNL problem_shape_mnl;
    PairLoad const* node;

    CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
      cute::Tensor coords = tC_cAux(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto const& a = *node->params_ptr;
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < cute::size(tC_rAux); ++k) {
        auto c = coords(k);
        tC_rAux(k) = cute::elem_less(c, problem_shape_mnl) ? a.ptr[pair_offset(a, c)] : Element(0);
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
    auto [tC_cAux, problem_shape_mnl] = thread_coordinates<ReferenceSrc>(args);
    cute::Tensor tC_rAux = cute::make_tensor<Element>(cute::take<0, 3>(cute::shape(tC_cAux)));
    return ConsumerStoreCallbacks<decltype(tC_rAux), decltype(tC_cAux), decltype(problem_shape_mnl)>(
        cute::move(tC_rAux), cute::move(tC_cAux), problem_shape_mnl, this);
  }
};

// A half-width output, staged in a [EpiM, EpiN / 2] shared-memory tile per stage (each thread writes
// the even slot of its pairs) that one warp stores with TMA when the collective stores D (same stages,
// fences and barriers as CUTLASS's Sm90AuxStore); TMA clips the ragged edges. Where the tensor's rows
// are not 16-byte aligned (TMA's rule), the values go straight from registers to global memory
// instead, predicated per value.
template <class EpiDesc, class Element>
struct PairStore : ConsumerOnlyNode {
  using EpiTile = typename EpiDesc::EpilogueTile;
  static constexpr int Stages = cutlass::epilogue::collective::detail::AuxStoreDescriptor<
      EpiDesc, cutlass::layout::RowMajor, Element>::Stages;
  static constexpr int EpiM = cute::size<0>(EpiTile{});
  static constexpr int EpiN = cute::size<1>(EpiTile{});
  static constexpr int OutN = EpiN / 2;  // the tile's columns in the output
  template <class X>
  CUTLASS_HOST_DEVICE static constexpr auto out_columns(X x) { return x / cute::_2{}; }  // tile or problem columns
  using SmemLayoutTma = cute::Layout<cute::Shape<cute::Int<EpiM>, cute::Int<OutN>>, cute::Stride<cute::Int<OutN>, cute::_1>>;
  using SmemLayout = cute::Layout<cute::Shape<cute::Int<EpiM>, cute::Int<OutN>, cute::Int<Stages>>,
                                  cute::Stride<cute::Int<OutN>, cute::_1, cute::Int<EpiM * OutN>>>;
  using StrideMNL = cute::Stride<int64_t, cute::_1, int64_t>;
  using TMA = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{},
      cute::make_tensor(static_cast<Element*>(nullptr), cute::make_layout(cute::make_shape(0, 0, 0), StrideMNL{})),
      SmemLayoutTma{}));

  struct SharedStorage {
    alignas(128) cute::array_aligned<Element, cute::cosize_v<SmemLayout>> smem;
  };
  using Arguments = PairArguments<Element*>;
  struct Params {
    Arguments args;
    TMA tma;
    bool use_tma;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void*) {
    auto [M, N, K, L] = cute::append<4>(problem_shape, 1);
    auto aligned = [](int64_t x) { return x * int64_t(sizeof(Element)) % 16 == 0; };
    bool use_tma = reinterpret_cast<uintptr_t>(args.ptr) % 16 == 0 && aligned(args.ld) && aligned(args.batch);
    TMA tma{};
    if (use_tma) {
      auto t = cute::make_tensor(args.ptr, cute::make_layout(cute::make_shape(int(M), out_columns(int(N)), int(L)),
                                                           StrideMNL{args.ld, cute::_1{}, args.batch}));
      tma = cute::make_tma_copy(cute::SM90_TMA_STORE{}, t, SmemLayoutTma{});
    }
    return {args, tma, use_tma};
  }
  CUTLASS_HOST_DEVICE PairStore() {}
  CUTLASS_HOST_DEVICE PairStore(Params const& params, SharedStorage const& shared)
      : params_ptr(&params), smem(const_cast<Element*>(shared.smem.data())) {}
  Params const* params_ptr = nullptr;
  Element* smem = nullptr;

  template <class RTensor, class LTensor, class CTensor, class ProblemShapeMNL, class STensor, class GTensor>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(LTensor&& local, CTensor&& c, ProblemShapeMNL shape, STensor&& s,
                                          GTensor&& g, PairStore const* node)
        : tC_lAux(cute::forward<LTensor>(local)), tC_cAux(cute::forward<CTensor>(c)), problem_shape_mnl(shape),
          bSG_sAux(cute::forward<STensor>(s)), bSG_gAux(cute::forward<GTensor>(g)), node(node) {}

    RTensor tC_rAux;  // this thread's values of the current epilogue subtile
    LTensor tC_lAux;  // their (m, n) within a subtile
    CTensor tC_cAux;  // their (m, n, l) in the problem, per subtile (the direct path)
    ProblemShapeMNL problem_shape_mnl;
    STensor bSG_sAux;  // (TMA, TMA_M, TMA_N, PIPE)
    GTensor bSG_gAux;  // (TMA, TMA_M, TMA_N, EPI_M, EPI_N)
    PairStore const* node;

    template <typename ElementAccumulator, int FragmentSize, class Fragment>
    CUTLASS_DEVICE Fragment visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int, int,
                                  Fragment const& frg) {
      using Convert = cutlass::NumericArrayConverter<Element, typename Fragment::Element, FragmentSize,
                                                     cutlass::FloatRoundStyle::round_to_nearest>;
      cute::recast<cutlass::Array<Element, FragmentSize>>(cute::coalesce(tC_rAux))(epi_v) = Convert{}(frg);
      return frg;
    }

    CUTLASS_DEVICE void postreduce(int, int, int store_iteration, bool issue_smem_store) {
      if (!node->params_ptr->use_tma || !issue_smem_store) return;
      Element* stage = node->smem + (store_iteration % Stages) * (EpiM * OutN);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < cute::size(tC_rAux); ++k) {
        auto c = tC_lAux(k);
        int m = cute::get<0>(c), n = cute::get<1>(c);
        if ((n & 1) == 0) stage[m * OutN + n / 2] = tC_rAux(k);
      }
    }

    CUTLASS_DEVICE void tma_store(int epi_m, int epi_n, int store_iteration, bool issue_tma_store) {
      if (node->params_ptr->use_tma && issue_tma_store) {
        cute::copy(node->params_ptr->tma, bSG_sAux(cute::_, cute::_, cute::_, store_iteration % Stages),
                   bSG_gAux(cute::_, cute::_, cute::_, epi_m, epi_n));
      }
    }

    CUTLASS_DEVICE void end_loop(int epi_m, int epi_n) {
      if (node->params_ptr->use_tma) return;
      cute::Tensor coords = tC_cAux(cute::_, cute::_, cute::_, epi_m, epi_n);
      Arguments const& a = node->params_ptr->args;
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < cute::size(tC_rAux); ++k) {
        auto c = coords(k);
        if (cute::elem_less(c, problem_shape_mnl) && (cute::get<1>(c) & 1) == 0) a.ptr[pair_offset(a, c)] = tC_rAux(k);
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto [tC_cAux, shape_mnl] = thread_coordinates<ReferenceSrc>(args);
    using RTensor = decltype(make_tensor<Element>(take<0, 3>(shape(tC_cAux))));
    // (m, n) of each value within its subtile: the same for every subtile, so subtile (0, 0)'s
    Tensor tC_cTile = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        make_identity_tensor(take<0, 2>(args.tile_shape_mnk)), args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor tC_lAux = tC_cTile(_, _, _, 0, 0);

    Tensor mAux = params_ptr->tma.get_tma_tensor(make_shape(int(M), out_columns(int(N)), int(L)));
    Tensor gAux = local_tile(mAux, make_shape(get<0>(args.tile_shape_mnk), out_columns(get<1>(args.tile_shape_mnk))),
                             make_coord(m, n, l));
    Tensor gAux_epi = flat_divide(gAux, make_shape(Int<EpiM>{}, Int<OutN>{}));  // (EpiM, OutN, EPI_M, EPI_N)
    Tensor sAux_epi = make_tensor(make_smem_ptr(smem), SmemLayout{});          // (EpiM, OutN, PIPE)
    auto thrblk_s2g = params_ptr->tma.get_slice(_0{});
    Tensor bSG_sAux = thrblk_s2g.partition_S(sAux_epi);
    Tensor bSG_gAux = thrblk_s2g.partition_D(gAux_epi);
    return ConsumerStoreCallbacks<RTensor, decltype(tC_lAux), decltype(tC_cAux), decltype(shape_mnl),
                                  decltype(bSG_sAux), decltype(bSG_gAux)>(
        cute::move(tC_lAux), cute::move(tC_cAux), shape_mnl, cute::move(bSG_sAux), cute::move(bSG_gAux), this);
  }
};

// ---- double width: 32-bit words of two 16-bit halves

struct NoArguments {};

// Converts each fragment element with `Fn`: a node with no state, arguments or memory of its own.
template <class Fn>
struct Convert : DirectNode<NoArguments> {
  using DirectNode<NoArguments>::DirectNode;

  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    template <class ElementAccumulator, int FragmentSize, class... Fragments>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int, int, int,
                              Fragments const&... in) {
      cutlass::Array<decltype(Fn{}(in[0]...)), FragmentSize> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) out[i] = Fn{}(in[i]...);
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const&) {
    return ConsumerStoreCallbacks{};
  }
};

// Half `Part` of a word (0: column 2n, 1: column 2n + 1) as fp32 (for bf16 a shift).
template <class Element, int Part>
struct UnpackFn {
  static_assert(cutlass::sizeof_bits<Element>::value == 16);
  CUTLASS_DEVICE float operator()(float word) const {  // a word's bits (evt.h: WideLoad)
    return float(Element::bitcast(static_cast<uint16_t>(__float_as_uint(word) >> (16 * Part))));
  }
};
template <class Element, int Part>
using Unpack = Convert<UnpackFn<Element, Part>>;

// Two values rounded to `Element` (to nearest even), one word: the first in the low half.
template <class Element>
struct PackFn {
  static_assert(cutlass::sizeof_bits<Element>::value == 16);
  template <class A, class B>
  CUTLASS_DEVICE float operator()(A a, B b) const {  // the word's bits, as a float (evt.h: WideStore)
    cutlass::NumericConverter<Element, A> lo;
    cutlass::NumericConverter<Element, B> hi;
    return __uint_as_float(uint32_t(lo(a).raw()) | (uint32_t(hi(b).raw()) << 16));
  }
};
template <class Element>
using Pack = Convert<PackFn<Element>>;

}  // namespace coda
