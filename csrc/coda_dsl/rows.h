// Per-row statistics CUTLASS has no node for: the log-sum-exp over n (cd.logsumexp) and the value
// at a per-row column (cd.take). Both are taps: they observe their input and pass it on. And the leaf
// that is cd.take's derivative: the one-hot of that column.
#pragma once

#include <cmath>

#include "coda_dsl/direct.h"
#include "coda_dsl/finish.h"

namespace coda {

// cd.logsumexp(x, axis="n"): each thread keeps a (reference point m, sum of exp(x - m)) pair per row it
// holds; at the end of the tile the lanes holding one row combine theirs with shuffles and one lane
// writes the tile's pair to partials [2][L][tiles][rows_padded] (reference points, then sums), which
// finish_logsumexp combines exactly (any reference point does: the pairs are rescaled to a common one).
// Values past (M, N) count as -inf (checked only on the tiles that reach past them).
// m is not the running max: a fragment (the values visit() gets at once) whose values are all finite and
// at most kLazyRescale above their rows' points adds them with one FFMA, compare, ex2 and add per value,
// their exps independent of one another; any other fragment (a value further above, +-inf, NaN, a point
// still -inf) moves its rows' points to their maxima, rescales each sum once and adds its values exactly.
// While a point is -inf its sum counts -inf values: m + log(s) is -inf all the same, and a finite point
// later multiplies the count by 0. Terms stay below e^kLazyRescale: sums of 10^9 of them are far inside
// fp32's range. The FFMA rounds m log2(e) once per row: every term of the row carries that relative error,
// at most 2^-24 |m| (2e-6 at |m| = 30, 6e-4 at |m| = 1e4).
// Where the epilogue is not hidden (the cooperative schedule; pingpong overlaps it with the other warp
// group's mainloop) its instructions show: on H100s, the cross-entropy's logits GEMM over a 4096-row
// chunk at V = 128256 (bench.sweep --only identity,ce_logits --shapes 4096x128256x4096) on the
// cooperative 256x128 1x2 tile took 1.389x cuBLAS's time with an exp, compare and branch per value (ncu:
// 2743 epilogue instructions per tile and warp, 691 with the identity epilogue), 1.138x with these paths
// (identity: 1.002x).
constexpr float kLazyRescale = 8.f;

struct LogSumExpArguments {
  float* partials = nullptr;
};

template <class TileShape>
struct RowLogSumExp : DirectNode<LogSumExpArguments> {
  using Base = DirectNode<LogSumExpArguments>;
  using Base::Base;

  template <class Registers, class Coords, class Shape, class LaneLayout>
  struct ConsumerStoreCallbacks : TapCallbacks<ConsumerStoreCallbacks<Registers, Coords, Shape, LaneLayout>> {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Registers points, Registers sums, Coords coords, Shape shape,
                                          bool inside, LaneLayout lanes, int lane_n, float* tile_pairs)
        : points(points), sums(sums), coords(coords), shape(shape), inside(inside), lanes(lanes),
          lane_n(lane_n), tile_pairs(tile_pairs) {}

    Registers points, sums;  // one slot per row of this thread: its reference point and sum
    Coords coords;           // (m, n, l) of this thread's values
    Shape shape;             // (M, N, L)
    bool inside;             // the whole tile is inside (M, N): no value needs its bounds check
    LaneLayout lanes;        // (lane along m, lane along n) -> lane index
    int lane_n;              // this lane's position along n
    float* tile_pairs;       // the partials: [2][L][tiles][rows_padded]

    // Adds the fragment's values to their rows' sums (Checked: on a tile that reaches past (M, N)).
    template <bool Checked, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE void accumulate(cutlass::Array<ElementInput, FragmentSize> const& frg_input, int epi_v,
                                   int epi_m, int epi_n) {
      cute::Tensor c = coords(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor m = points(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor s = sums(cute::_, cute::_, cute::_, epi_m, epi_n);
      float x[FragmentSize], d[FragmentSize];  // the values, and log2 of their terms: (x - m) log2(e)
      bool near = true;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {  // columns past N count as -inf: they add nothing to the sum
        int k = epi_v * FragmentSize + i;
        x[i] = !Checked || cute::elem_less(c(k), shape) ? float(frg_input[i]) : -INFINITY;
        d[i] = fmaf(x[i], kLog2e, -m(k) * kLog2e);
        near &= d[i] < kLazyRescale * kLog2e;  // false for NaN: an infinite value at an infinite point
      }
      if (near) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) s(epi_v * FragmentSize + i) += exp2_ftz(d[i]);
        return;
      }
      // Rare with finite logits (a row's first fragment in the tile, from the point -inf): the fragment's rows
      // move their points to their maxima, each sum rescaled once; then the values add exactly, infinities
      // and NaN included.
      cute::Tensor row_m = cute::filter_zeros(m), row_s = cute::filter_zeros(s);  // one slot per row
      float before[cute::size(row_m)];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < cute::size(row_m); ++r) before[r] = row_m(r);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        int k = epi_v * FragmentSize + i;
        m(k) = fmaxf(m(k), x[i]);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < cute::size(row_m); ++r) {
        row_s(r) *= before[r] == row_m(r) ? 1.f : fast_exp(before[r] - row_m(r));
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        int k = epi_v * FragmentSize + i;
        s(k) += x[i] == m(k) ? 1.f : fast_exp(x[i] - m(k));  // equal infinities count 1, not exp(NaN)
      }
    }

    CUTLASS_DEVICE void end() {
      cute::Tensor m = cute::filter_zeros(points);
      cute::Tensor s = cute::filter_zeros(sums);
      CUTLASS_PRAGMA_UNROLL
      for (int step = cute::size<1>(lanes) / 2; step > 0; step /= 2) {  // lanes of one row: a tree
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < cute::size(m); ++r) {
          float m2 = __shfl_down_sync(0xFFFFFFFF, m(r), lanes(0, step));
          float s2 = __shfl_down_sync(0xFFFFFFFF, s(r), lanes(0, step));
          merge_logsumexp(m(r), s(r), m2, s2);  // as the finishing kernel merges the tiles' pairs
        }
      }
      if (lane_n != 0) return;
      Partials p = coda::row_partials<TileShape>(cute::get<0>(shape), cute::get<1>(shape));
      cute::Tensor c = slot_coordinates(points, coords);  // a row's first column of this thread: its n tile
      int tile_n = cute::size<1>(TileShape{});
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < cute::size(m); ++r) {
        int row = cute::get<0>(c(r)), tile = cute::get<1>(c(r)) / tile_n, l = cute::get<2>(c(r));
        if (row < p.rows && tile < p.tiles && l < cute::get<2>(shape)) {
          int64_t at = (int64_t(l) * p.tiles + tile) * p.rows_padded + row;
          tile_pairs[at] = m(r);
          tile_pairs[at + p.size(cute::get<2>(shape))] = s(r);
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [coords, shape_mnl] = thread_coordinates<ReferenceSrc>(args);
    auto points = statistic_registers<float, ReferenceSrc, true>(args);
    auto sums = make_tensor_like(points);
    fill(points, -INFINITY);
    fill(sums, 0.f);
    auto [lanes, lane_m, lane_n] = warp_lanes<ReferenceSrc, true>(args);
    return ConsumerStoreCallbacks<decltype(points), decltype(coords), decltype(shape_mnl), decltype(lanes)>(
        points, sums, coords, shape_mnl, tile_inside(args), lanes, lane_n, this->params_ptr->partials);
  }
};

// The state of a node that reads, per row this thread holds, the column index[l, m] (cd.take, and its
// derivative's one-hot): `targets` (from statistic_registers) holds it from begin() on, -1 where the row,
// or its index, lies outside (M, N).
template <class Registers, class Coords, class Shape, class Arguments>
struct RowTargets : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
  CUTLASS_DEVICE RowTargets(Registers targets, Coords coords, Shape shape, Arguments const* args)
      : targets(targets), coords(coords), shape(shape), args(args) {}

  Registers targets;
  Coords coords;
  Shape shape;
  Arguments const* args;

  CUTLASS_DEVICE void begin() {
    cute::Tensor t = cute::filter_zeros(targets);
    cute::Tensor c = slot_coordinates(targets, coords);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < cute::size(t); ++r) {
      int row = cute::get<0>(c(r)), l = cute::get<2>(c(r));
      int64_t index = -1;
      if (row < cute::get<0>(shape) && l < cute::get<2>(shape)) index = args->index[l * args->index_batch + row];
      t(r) = index >= 0 && index < cute::get<1>(shape) ? int(index) : -1;
    }
  }

  // Whether value k of subtile (epi_m, epi_n) is its row's target column.
  CUTLASS_DEVICE bool hit(int k, int epi_m, int epi_n) const {
    return cute::get<1>(coords(cute::_, cute::_, cute::_, epi_m, epi_n)(k)) ==
           targets(cute::_, cute::_, cute::_, epi_m, epi_n)(k);
  }
};

// The node of such callbacks: Callbacks<Registers, Coords, Shape> is a RowTargets over Arguments.
template <class Arguments, template <class, class, class> class Callbacks>
struct RowTargetsNode : DirectNode<Arguments> {
  using DirectNode<Arguments>::DirectNode;

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto [coords, shape] = thread_coordinates<ReferenceSrc>(args);
    auto targets = statistic_registers<int, ReferenceSrc, true>(args);
    return Callbacks<decltype(targets), decltype(coords), decltype(shape)>(targets, coords, shape, this->params_ptr);
  }
};

// cd.take(x, index, axis="n"): out[l, m] = x[l, m, index[l, m]], written by the one thread holding
// that column (no atomics). The runtime zero-fills out first: rows whose index is outside [0, N)
// keep 0.
struct TakeArguments {
  int64_t const* index = nullptr;
  float* out = nullptr;
  int64_t index_batch = 0;  // batch strides of the [L, M] index and output (0: shared index)
  int64_t out_batch = 0;
};

template <class Registers, class Coords, class Shape>
struct TakeCallbacks : RowTargets<Registers, Coords, Shape, TakeArguments> {
  using RowTargets<Registers, Coords, Shape, TakeArguments>::RowTargets;

  template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
  CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m,
                            int epi_n, cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
    bool any = false;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < FragmentSize; ++i) any |= this->hit(epi_v * FragmentSize + i, epi_m, epi_n);
    if (any) {  // rare: one branch per fragment, not per value
      cute::Tensor c = this->coords(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        int k = epi_v * FragmentSize + i;
        if (this->hit(k, epi_m, epi_n)) {  // in bounds: begin() kept only columns and rows inside
          this->args->out[cute::get<2>(c(k)) * this->args->out_batch + cute::get<0>(c(k))] = float(frg_input[i]);
        }
      }
    }
    return frg_input;
  }
};

struct RowTake : RowTargetsNode<TakeArguments, TakeCallbacks> {
  using RowTargetsNode<TakeArguments, TakeCallbacks>::RowTargetsNode;
};

// The one-hot of a per-row column index (cd.take's derivative scatters its gradient with it): 1 at column
// index[l, m] of row m, else 0, as a leaf of the tree. Rows whose index is outside [0, N) are all 0.
struct OneHotArguments {
  int64_t const* index = nullptr;
  int64_t index_batch = 0;  // the [L, M] index's batch stride (0: shared)
};

template <class Registers, class Coords, class Shape>
struct OneHotCallbacks : RowTargets<Registers, Coords, Shape, OneHotArguments> {
  using RowTargets<Registers, Coords, Shape, OneHotArguments>::RowTargets;

  template <typename ElementAccumulator, int FragmentSize>
  CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const&,
                                                           int epi_v, int epi_m, int epi_n) {
    cutlass::Array<float, FragmentSize> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < FragmentSize; ++i) out[i] = this->hit(epi_v * FragmentSize + i, epi_m, epi_n) ? 1.f : 0.f;
    return out;
  }
};

struct RowOneHot : RowTargetsNode<OneHotArguments, OneHotCallbacks> {
  using RowTargetsNode<OneHotArguments, OneHotCallbacks>::RowTargetsNode;
};

}  // namespace coda
