// What completes a reduction: the GEMM's last tile of each row (column) block for row and column sums
// (FinishedReduction), else a small kernel after the GEMM that combines per-tile partials in a fixed
// order (deterministic mode) and applies the finishing expression (`.then(...)`), in one pass.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <tuple>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "coda_dsl/abi.h"
#include "coda_dsl/device.h"
#include "coda_dsl/direct.h"
#include "coda_dsl/functional.h"

namespace coda {

struct Plus { CUTLASS_DEVICE float operator()(float a, float b) const { return a + b; } };
struct Max { CUTLASS_DEVICE float operator()(float a, float b) const { return coda::maximum(a, b); } };
struct Min { CUTLASS_DEVICE float operator()(float a, float b) const { return coda::minimum(a, b); } };

template <class T>
struct Identity {
  template <class Args>
  CUTLASS_HOST_DEVICE T operator()(T const& x, Args const&) const { return x; }
};

// Row finishing kernels: a block covers kRows rows (threadIdx.x) and splits each row's tiles over
// kSplit threads (threadIdx.y: tiles y, y + kSplit, ...), then combines their results in the fixed
// order y = 0, 1, ...: deterministic run to run. One thread per row walking all of a row's tiles
// (~1000 at V = 128256) used 16 blocks for 4096 rows and took 0.26 ms on the H200.
constexpr int kRows = 32, kSplit = 16;

inline dim3 row_grid(int64_t rows_times_l) { return dim3(unsigned((rows_times_l + kRows - 1) / kRows)); }

// out[l, r] = fn(combine_t partial[l, t, r]) for r < rows; partials are [L, tiles, rows_padded].
template <class Combine, class Fn, class Args>
__global__ void finish_rows(float const* partial, float* out, int rows, int64_t rows_padded, int tiles, int L,
                            float identity, Args args) {
  __shared__ float part[kSplit][kRows];
  int64_t i = int64_t(blockIdx.x) * kRows + threadIdx.x;
  bool live = i < int64_t(rows) * L;
  float acc = identity;
  if (live) {
    int64_t l = i / rows, r = i % rows;
    float const* p = partial + l * tiles * rows_padded + r;
    for (int t = threadIdx.y; t < tiles; t += kSplit) acc = Combine{}(acc, p[t * rows_padded]);
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || !live) return;
  for (int y = 1; y < kSplit; ++y) acc = Combine{}(acc, part[y][threadIdx.x]);
  out[i] = Fn{}(acc, args);
}

// out[l] = fn(combine over r < rows, t < tiles of partial[l, t, r]): one block per l, fixed-order tree.
template <class Combine, class Fn, class Args>
__global__ void finish_total(float const* partial, float* out, int rows, int64_t rows_padded, int tiles,
                             float identity, Args args) {
  __shared__ float part[256];
  float const* p = partial + int64_t(blockIdx.x) * tiles * rows_padded;
  float acc = identity;
  for (int64_t i = threadIdx.x; i < int64_t(rows) * tiles; i += blockDim.x)
    acc = Combine{}(acc, p[(i / rows) * rows_padded + i % rows]);
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) part[threadIdx.x] = Combine{}(part[threadIdx.x], part[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = Fn{}(part[0], args);
}

template <class Combine, class Fn, class Args>
void finish(float const* partial, float* out, int rows, int64_t rows_padded, int tiles, int L, bool total,
            float identity, Args const& args, Call const& call, char const* op_name) {
  cudaStream_t stream = call.stream;
  if (L == 0 || (!total && rows == 0)) return;
  if (total) {
    finish_total<Combine, Fn, Args><<<L, 256, 0, stream>>>(partial, out, rows, rows_padded, tiles, identity, args);
  } else {
    finish_rows<Combine, Fn, Args><<<row_grid(int64_t(rows) * L), dim3(kRows, kSplit), 0, stream>>>(
        partial, out, rows, rows_padded, tiles, L, identity, args);
  }
  check_cuda(cudaGetLastError(), op_name, "finishing kernel");
}

// An fp32 output of up to two dimensions (strides of the caller's tensor) to be set to `value` before the
// GEMM: the identity atomic reductions start from, the 0 of cd.take's rows.
struct Fill {
  Fill() = default;
  Fill(TensorRef const& out, float value)
      : out(out.data_ptr<float>()), rows(out.dim() == 2 ? out.size(0) : 1), cols(out.dim() >= 1 ? out.size(-1) : 1),
        row_stride(out.dim() == 2 ? out.stride(0) : 0), col_stride(out.dim() >= 1 ? out.stride(-1) : 0), value(value) {}
  float* out = nullptr;
  int64_t rows = 0, cols = 0, row_stride = 0, col_stride = 0;
  float value = 0.f;
};

constexpr int kFills = 16;  // outputs per launch (a kernel argument of 16 Fills: 768 bytes)
struct Fills {
  Fill at[kFills];
};

// blockIdx.y picks the output, blockIdx.x a span of its elements.
__global__ void fill_outputs(Fills fills) {
  Fill const& f = fills.at[blockIdx.y];
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < f.rows * f.cols) f.out[(i / f.cols) * f.row_stride + (i % f.cols) * f.col_stride] = f.value;
}

// Every output of `targets` filled, in one launch (one per kFills of them).
inline void fill(std::initializer_list<Fill> targets, Call const& call, char const* op_name) {
  Fill const* next = targets.begin();
  for (size_t left = targets.size(); left > 0;) {
    int count = int(std::min<size_t>(left, kFills));
    Fills fills;
    int64_t most = 0;
    for (int j = 0; j < count; ++j) {
      fills.at[j] = next[j];
      most = std::max(most, next[j].rows * next[j].cols);
    }
    next += count;
    left -= size_t(count);
    if (most == 0) continue;
    fill_outputs<<<dim3(unsigned((most + 255) / 256), unsigned(count)), 256, 0, call.stream>>>(fills);
    check_cuda(cudaGetLastError(), op_name, "fill kernel");
  }
}

// Layout of per-tile partials (CUTLASS's FinalReduction=false, and RowLogSumExp's): [L, tiles,
// rows_padded], rows m-major.
struct Partials {
  int rows, tiles;
  int64_t rows_padded;
  CUTLASS_HOST_DEVICE int64_t size(int L) const { return int64_t(L) * tiles * rows_padded; }
};
template <class TileShape>
CUTLASS_HOST_DEVICE Partials partials(int M, int N, bool over_n) {
  int tm = cute::size<0>(TileShape{}), tn = cute::size<1>(TileShape{});
  int rows = over_n ? M : N, rt = over_n ? tm : tn, other = over_n ? N : M, ot = over_n ? tn : tm;
  return {rows, (other + ot - 1) / ot, int64_t((rows + rt - 1) / rt) * rt};
}

// (m, s) <- the log-sum-exp pair of (m, s) and (mt, st), each a (reference point, sum of exp(x - point)),
// the larger point kept: equal points (infinite ones too) need no scaling, and a -inf point never meets
// exp(-inf - -inf).
CUTLASS_DEVICE void merge_logsumexp(float& m, float& s, float mt, float st) {
  if (mt > m) {
    s = s * expf(m - mt) + st;
    m = mt;
  } else {
    s += mt == m ? st : st * expf(mt - m);
  }
}

// out[l, r] = fn(log sum_t s_t exp(m_t)) from the (m_t, s_t) = (reference point, sum of exp(x - m_t)) pair
// of every tile t, points before sums in `partial` (cd.logsumexp); rows split over threads as finish_rows.
template <class Fn, class Args>
__global__ void finish_logsumexp_rows(float const* partial, float* out, Partials p, int L, Args args) {
  __shared__ float points[kSplit][kRows], sums[kSplit][kRows];
  int64_t i = int64_t(blockIdx.x) * kRows + threadIdx.x;
  bool live = i < int64_t(p.rows) * L;
  float mm = -INFINITY, sum = 0.f;
  if (live) {
    int64_t l = i / p.rows, r = i % p.rows;
    float const* m = partial + l * p.tiles * p.rows_padded + r;
    float const* s = m + p.size(L);
    for (int t = threadIdx.y; t < p.tiles; t += kSplit)
      merge_logsumexp(mm, sum, m[t * p.rows_padded], s[t * p.rows_padded]);
  }
  points[threadIdx.y][threadIdx.x] = mm;
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || !live) return;
  for (int y = 1; y < kSplit; ++y) merge_logsumexp(mm, sum, points[y][threadIdx.x], sums[y][threadIdx.x]);
  out[i] = Fn{}(mm + logf(sum), args);
}

template <class Fn, class Args>
void finish_logsumexp(float const* partial, float* out, Partials p, int L, Args const& args, Call const& call,
                      char const* op_name) {
  int64_t n = int64_t(p.rows) * L;
  if (n == 0) return;
  finish_logsumexp_rows<Fn, Args><<<row_grid(n), dim3(kRows, kSplit), 0, call.stream>>>(partial, out, p, L, args);
  check_cuda(cudaGetLastError(), op_name, "finishing kernel");
}

// Memory whose bytes are zero whenever no kernel on its stream runs: a kernel that uses it sets back
// what it changed before it ends, so the next one needs no launch to zero it. One buffer per device,
// stream and slot, grown in stream order; while the stream is captured into a CUDA graph, the call's
// workspace instead, zeroed by a memset that the graph replays. (A stream destroyed with such a kernel
// still queued, and a new stream given its handle at once, would share the buffer: torch never destroys
// its streams.)
inline void* zero_at_rest(Call const& call, Workspace& ws, int slot, int64_t bytes, char const* op_name) {
  void* own = ws.take(bytes);  // in every call: a size query cannot know whether the launch is captured
  if (call.query || bytes == 0) return nullptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(call.stream, &capture), op_name, "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) {
    check_cuda(cudaMemsetAsync(own, 0, size_t(bytes), call.stream), op_name, "zeroing the reductions' counters");
    return own;
  }
  struct Buffer {
    void* data = nullptr;
    int64_t bytes = 0;
  };
  static std::mutex mutex;
  static std::map<std::tuple<int, CUstream_st*, int>, Buffer> buffers;
  std::lock_guard<std::mutex> lock(mutex);
  Buffer& b = buffers[{call.device, call.stream, slot}];
  if (b.bytes < bytes) {
    if (b.data) check_cuda(cudaFreeAsync(b.data, call.stream), op_name, "cudaFreeAsync");
    b = Buffer{};
    int64_t grown = std::max<int64_t>(bytes, 64 << 10);
    check_cuda(cudaMallocAsync(&b.data, size_t(grown), call.stream), op_name, "cudaMallocAsync");
    check_cuda(cudaMemsetAsync(b.data, 0, size_t(grown), call.stream), op_name, "zeroing the reductions' counters");
    b.bytes = grown;
  }
  return b.data;
}

// A FinishedReduction's two zero-at-rest buffers: the statistic's running totals [L, rows] and a tile
// counter per row block [L, blocks] (rows: M over n, N over m).
struct Totals {
  float* scratch = nullptr;
  int* counters = nullptr;
};

template <class TileShape>
Totals totals_at_rest(Call const& call, Workspace& ws, int slot, int M, int N, int L, bool over_n, char const* op_name) {
  int rows = over_n ? M : N, tile = over_n ? cute::size<0>(TileShape{}) : cute::size<1>(TileShape{});
  int64_t scratch_bytes = (int64_t(L) * rows * int64_t(sizeof(float)) + 255) / 256 * 256;
  int64_t blocks = int64_t(L) * ((rows + tile - 1) / tile);
  auto* p = static_cast<char*>(zero_at_rest(call, ws, slot, scratch_bytes + blocks * int64_t(sizeof(int)), op_name));
  if (!p) return {};
  return {reinterpret_cast<float*>(p), reinterpret_cast<int*>(p + scratch_bytes)};
}

// A row statistic over n (Inner: CUTLASS's atomic Sm90ColReduction) or a column statistic over m (its
// Sm90RowReduction) whose identity is 0 (sum, amax), completed by the GEMM itself: no launch before it to
// set the output to the identity, none after it for `.then`. Inner adds each tile's partials into
// `scratch`, zero at rest; then each tile counts itself in its row block's counter (zero at rest too),
// and the block's last tile applies Fn to the block's totals, stores them in `out` and sets the scratch
// and the counter back to zero. Not deterministic: the atomics' order varies, as before.
template <class Inner, class Fn, class FnArgs, class TileShape, bool OverN>
struct FinishedReduction : ConsumerOnlyNode {
  using SharedStorage = typename Inner::SharedStorage;
  struct Arguments {
    typename Inner::Arguments inner;  // its pointer is `scratch`
    float* scratch = nullptr;         // [L, rows]
    float* out = nullptr;             // [L, rows]
    int* counters = nullptr;          // [L, blocks]
    FnArgs fn{};
  };
  struct Params {
    typename Inner::Params inner;
    Arguments args;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* ws) {
    return {Inner::to_underlying_arguments(shape, args.inner, ws), args};
  }

  CUTLASS_HOST_DEVICE FinishedReduction() {}
  CUTLASS_HOST_DEVICE FinishedReduction(Params const& params, SharedStorage const& shared)
      : params(params), inner(params.inner, shared) {}
  Params params;
  Inner inner;

  template <class InnerCallbacks>
  struct ConsumerStoreCallbacks : InnerCallbacks {  // Inner's callbacks, with the count and the last tile's work
    CUTLASS_DEVICE ConsumerStoreCallbacks(InnerCallbacks&& base, Arguments const* args, int64_t first, int count,
                                          int* counter, int expected, int thread, int threads)
        : InnerCallbacks(static_cast<InnerCallbacks&&>(base)), finishing(args), first(first), count(count),
          counter(counter), expected(expected), thread(thread), threads(threads) {}

    Arguments const* finishing;
    int64_t first;  // the block's first total in scratch and out
    int count;      // its totals (rows past the problem's not counted)
    int* counter;   // null: a tile outside the problem, which Inner skips (a cluster's padding)
    int expected;   // the block's tiles
    int thread, threads;
    bool last = false;

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&& smem, SyncFn const& sync_fn, int epi_m, int epi_n, bool is_last_iteration,
                               VTensor visit_results) {
      InnerCallbacks::reduce(smem, sync_fn, epi_m, epi_n, is_last_iteration, visit_results);
      if (!is_last_iteration || !counter) return;  // uniform over the tile's threads
      __threadfence();  // this thread's atomics reach memory before the tile is counted
      sync_fn();
      int* seen = reinterpret_cast<int*>(cute::raw_pointer_cast(smem.data()));
      if (thread == 0) *seen = atomicAdd(counter, 1);
      sync_fn();
      last = *seen == expected - 1;
      sync_fn();  // read before the subtile's values reuse the buffer
    }

    CUTLASS_DEVICE void end() {
      InnerCallbacks::end();
      if (!last) return;
      __threadfence();
      for (int i = thread; i < count; i += threads) {
        float total = __ldcg(finishing->scratch + first + i);  // from L2, where the atomics went
        __stcg(finishing->scratch + first + i, 0.f);
        finishing->out[first + i] = Fn{}(total, finishing->fn);
      }
      if (thread == 0) *counter = 0;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto base = inner.template get_consumer_store_callbacks<ReferenceSrc>(args);
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    constexpr int tm = cute::size<0>(TileShape{}), tn = cute::size<1>(TileShape{});
    int rows = OverN ? M : N, tile = OverN ? tm : tn, block = OverN ? m : n;
    int other = OverN ? N : M, other_tile = OverN ? tn : tm;
    bool inside = m * tm < M && n * tn < N;
    int blocks = (rows + tile - 1) / tile;
    int first = block * tile;
    int* counter = inside ? params.args.counters + int64_t(l) * blocks + block : nullptr;
    return ConsumerStoreCallbacks<decltype(base)>(
        static_cast<decltype(base)&&>(base), &params.args, int64_t(l) * rows + first, cute::min(tile, rows - first),
        counter, (other + other_tile - 1) / other_tile, int(args.thread_idx),
        int(decltype(args.tiled_copy)::TiledNumThr::value));
  }
};

}  // namespace coda
