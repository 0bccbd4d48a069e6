// The small kernel that completes a reduction after the GEMM: combine per-tile partials in a fixed
// order (deterministic mode) and apply the finishing expression (`.then(...)`), in one pass.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "coda_dsl/abi.h"
#include "coda_dsl/device.h"
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
// Per-row partials (a statistic over n): one per row and tile column, [L, N tiles, M padded to the tile].
template <class TileShape>
CUTLASS_HOST_DEVICE Partials row_partials(int M, int N) {
  int tm = cute::size<0>(TileShape{}), tn = cute::size<1>(TileShape{});
  return {M, (N + tn - 1) / tn, int64_t((M + tm - 1) / tm) * tm};
}

// Per-column partials of coda::ColumnReduction (deterministic mode): a row of N per tile row and warp
// holding that tile's values, [L, tiles * warps, N].
template <class TileShape>
CUTLASS_HOST_DEVICE Partials column_partials(int M, int N, int warps) {
  int tm = cute::size<0>(TileShape{});
  return {N, (M + tm - 1) / tm * warps, int64_t(N)};
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

}  // namespace coda
