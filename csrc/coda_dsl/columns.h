// Per-column statistics combined with atomics: cd.sum / max / min / amax(x, axis="m") into an [N] or
// [L, N] output the runtime filled with the reduction's identity (a bias's gradient, a norm weight's).
// CUTLASS's Sm90RowReduction does this, at two costs this node avoids. It checks every value against
// (M, N); here only tiles that reach past them do. And on the pingpong tiles (128x128, 128x192) and the
// cooperative 128x128 one its end-of-tile exchange indexes registers by lane: ptxas put its state in
// local memory (352-832 byte stack frames) and left the loop rolled. Here every index is a compile-time one.
// Each thread adds its values into one register per column it holds in the current epilogue subtile.
// Once a column of subtiles is done, the lanes of a warp that share columns halve their registers at each
// exchange (a lane keeps half of its columns and sends the other half to its partner; an odd count is
// exchanged whole), so each lane ends holding the
// warp's totals of a few columns: one atomic per column and warp along m, 32 lanes at a time where a
// thread's column count is a multiple of the lanes along m (8 on every GMMA tile).
// Deterministic mode: the same, but each warp stores its totals into a row of per-tile partials of its own
// (no atomics) and the finishing kernel combines the rows in a fixed order.
#pragma once

#include <type_traits>

#include "cutlass/gemm/dispatch_policy.hpp"
#include "coda_dsl/direct.h"

namespace coda {

// The warps that hold one tile's values in the epilogue: the cooperative kernel's two warp groups share a
// tile, pingpong's each have their own.
template <class KernelSchedule>
constexpr int kTileWarps = std::is_same_v<KernelSchedule, cutlass::gemm::KernelTmaWarpSpecializedCooperative> ? 8 : 4;

template <class T>
struct store_value {  // a warp's totals into its own row of partials
  CUTLASS_DEVICE void operator()(T* ptr, T value) const { *ptr = value; }
};

// How many registers a lane still holds after `steps` exchanges, from `slots`: halved while even.
constexpr int held_after(int slots, int steps) {
  return steps == 0 ? slots : held_after(slots % 2 == 0 ? slots / 2 : slots, steps - 1);
}

struct ColumnReductionArguments {
  float* out = nullptr;
  float identity = 0.f;
  int64_t batch = 0;  // batch stride: of the [L, N] output, or of the [L, tiles * warps, N] partials
  int64_t row = 0;    // stride of a (tile row, warp)'s row of partials; 0: every warp adds into the output
};

// Reduce: adds a value into a column's register; Combine: merges two registers; Write: a warp's totals into
// the output (an atomic) or into its row of partials (store_value, with TileWarps = kTileWarps<schedule>).
template <template <class> class Reduce, template <class> class Combine, template <class> class Write,
          int TileWarps = 0>
struct ColumnReduction : DirectNode<ColumnReductionArguments> {
  using Base = DirectNode<ColumnReductionArguments>;
  using Base::Base;

  template <class Registers, class Coords, class Shape, class LaneLayout>
  struct ConsumerStoreCallbacks : TapCallbacks<ConsumerStoreCallbacks<Registers, Coords, Shape, LaneLayout>> {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Registers totals, Coords coords, Shape shape, bool inside, LaneLayout lanes,
                                          int lane_m, int lane_n, int64_t partial_row, bool live,
                                          ColumnReductionArguments const* args)
        : totals(totals), coords(coords), shape(shape), inside(inside), lanes(lanes), lane_m(lane_m),
          lane_n(lane_n), partial_row(partial_row), live(live), args(args) {}

    Registers totals;   // one slot per column of this thread in the current epilogue subtile
    Coords coords;      // (m, n, l) of this thread's values
    Shape shape;        // (M, N, L)
    bool inside;        // the whole tile is inside (M, N): no value needs its bounds check
    LaneLayout lanes;   // (lane along m, lane along n) -> lane index
    int lane_m, lane_n;  // this lane's place in it
    int64_t partial_row;  // this warp's row of partials: tile row * TileWarps + warp (0 for atomics)
    bool live;            // the tile has a row inside M (a cluster's other CTA may lie wholly past it)
    ColumnReductionArguments const* args;

    template <bool Checked, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE void accumulate(cutlass::Array<ElementInput, FragmentSize> const& frg_input, int epi_v,
                                   int epi_m, int epi_n) {
      cute::Tensor c = coords(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        int k = epi_v * FragmentSize + i;
        if (!Checked || cute::elem_less(c(k), shape)) totals(k) = Reduce<float>{}(totals(k), float(frg_input[i]));
      }
    }

    // CUTLASS's collective walks the subtiles epi_m within epi_n (and, with its separate stream-K reduction
    // disabled, every subtile in one call): a subtile column's totals are complete after its last epi_m.
    CUTLASS_DEVICE void end_loop(int epi_m, int epi_n) {
      if (epi_m != decltype(cute::size<3>(coords))::value - 1 || !live) return;  // uniform per tile
      constexpr int kSlots = decltype(cute::size(cute::filter_zeros(totals)))::value;
      constexpr int kLanesM = decltype(cute::size<0>(lanes))::value;
      cute::Tensor slots = cute::filter_zeros(totals);
      float v[kSlots];
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kSlots; ++s) v[s] = slots(s);
      cute::fill(totals, args->identity);  // for the next subtile column
      constexpr int kSteps = cute::log_2(uint32_t(kLanesM));
      int first = 0;       // v[r] holds the totals of slot first + r
      bool writer = true;  // false: a lane whose partner holds the same totals and writes them
      cute::for_each(cute::make_int_sequence<kSteps>{}, [&](auto j) {
        constexpr int step = kLanesM >> (decltype(j)::value + 1);  // the partner's distance along m
        constexpr int held = held_after(kSlots, decltype(j)::value);
        bool upper = lane_m & step;
        int partner = lanes(lane_m ^ step, lane_n);
        if constexpr (held % 2 == 0) {  // keep the upper or lower half, send the other
          constexpr int half = held / 2;
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < half; ++r) {
            float keep = upper ? v[r + half] : v[r], send = upper ? v[r] : v[r + half];
            v[r] = Combine<float>{}(keep, __shfl_sync(0xFFFFFFFF, send, partner));
          }
          first += upper ? half : 0;
        } else {  // an odd count: both exchange all, the lower one writes
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < held; ++r) v[r] = Combine<float>{}(v[r], __shfl_sync(0xFFFFFFFF, v[r], partner));
          writer &= !upper;
        }
      });
      if (!writer) return;
      cute::Tensor c = slot_coordinates(totals, coords(cute::_, cute::_, cute::_, 0, epi_n));
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < held_after(kSlots, kSteps); ++r) {
        auto crd = c(first + r);
        int n = cute::get<1>(crd), l = cute::get<2>(crd);
        if (n < cute::get<1>(shape)) Write<float>{}(args->out + l * args->batch + partial_row * args->row + n, v[r]);
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto [coords, shape] = thread_coordinates<ReferenceSrc>(args);
    auto totals = cute::make_tensor_like(  // one subtile's: (CPY, CPY_M, CPY_N)
        statistic_registers<float, ReferenceSrc, false>(args)(cute::_, cute::_, cute::_, 0, 0));
    cute::fill(totals, this->params_ptr->identity);
    // partials: every warp holds all of a tile's columns (each gets a full row), TileWarps of them per tile
    auto [lanes, lane_m, lane_n] = warp_lanes<ReferenceSrc, TileWarps != 0>(args);
    static_assert(TileWarps == 0 || TileWarps * 32 == decltype(args.tiled_copy)::TiledNumThr::value);
    int64_t partial_row = TileWarps ? int64_t(cute::get<0>(args.tile_coord_mnkl)) * TileWarps + args.thread_idx / 32 : 0;
    bool live = cute::get<0>(args.tile_coord_mnkl) * cute::size<0>(args.tile_shape_mnk) < cute::get<0>(shape);
    return ConsumerStoreCallbacks<decltype(totals), decltype(coords), decltype(shape), decltype(lanes)>(
        totals, coords, shape, tile_inside(args), lanes, lane_m, lane_n, partial_row, live, this->params_ptr);
  }
};

}  // namespace coda
