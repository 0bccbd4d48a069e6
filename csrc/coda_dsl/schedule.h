// How a launch orders its tiles, chosen per problem on the host (no device code: tests compile it alone).
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"

namespace coda {

// The swizzle for a problem: the largest (at most `most`, for its L2 reuse) whose rounding schedules at
// most 2 % more tiles than the least any swizzle schedules. CUTLASS's persistent scheduler rounds both
// tile counts up to a multiple of swizzle x cluster size and runs the tiles added (empty, but a full
// mainloop each): with 8 and a 2x1 cluster, 7 tiles along M (M = 777) are run as 16.
template <class TileShape, class ClusterShape>
int swizzle_for(int64_t m, int64_t n, int most) {
  using Params = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;
  auto up = [](int64_t x, int64_t to) { return (x + to - 1) / to * to; };
  int64_t const cm = cute::size<0>(ClusterShape{}), cn = cute::size<1>(ClusterShape{});
  int64_t const tm = up((m + cute::size<0>(TileShape{}) - 1) / cute::size<0>(TileShape{}), cm);
  int64_t const tn = up((n + cute::size<1>(TileShape{}) - 1) / cute::size<1>(TileShape{}), cn);
  auto tiles = [&](int s) {
    int64_t const g = int64_t(1) << Params::get_log_swizzle_size(int(tm), int(tn), s);  // what CUTLASS takes
    return up(tm, g * cm) * up(tn, g * cn);
  };
  int64_t fewest = tiles(1);  // no rounding but the cluster's
  int s = most;
  while (s > 1 && tiles(s) * 50 > fewest * 51) s /= 2;
  return s;
}

}  // namespace coda
