// The plain-data interface of a kernel library: what its two `extern "C"` functions receive from
// the Python caller (coda_dsl/runtime/kernel.py), and how errors go back. No torch, ATen, c10,
// pybind11, Python or CUDA header: a kernel's translation unit compiles CUTLASS and this, nothing more;
// the warm call path (coda_dsl/runtime/warm.cpp) fills the same block.
//
//   int coda_workspace_size(CallArgs const* args, int64_t* size, char* message, int64_t message_size);
//   int coda_launch(CallArgs const* args, char* message, int64_t message_size);
//
// args: one block of int64s, packed by one struct.pack call: the CallArgs header, then a TensorArg per
// tensor (A, B, then D if the kernel stores one, the operands, the auxiliary outputs, in the order
// the plan binds them), then the scalars as doubles. One pointer instead of ten arguments: a ctypes
// call costs about 0.35 µs instead of 0.9. Both return 0, or 1 with a message (NUL-terminated,
// truncated to fit).
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

struct CUstream_st;  // cuda_runtime.h's cudaStream_t is a CUstream_st*

namespace coda {

// One tensor: data pointer, rank (0 to 3), sizes and strides in elements. Eight int64, packed by
// runtime/kernel.py with the struct format "8q" per tensor.
struct TensorArg {
  int64_t data;
  int64_t dim;
  int64_t sizes[3];
  int64_t strides[3];
};
static_assert(sizeof(TensorArg) == 64, "the layout runtime/kernel.py packs");

// A TensorArg read like an at::Tensor (negative dimensions count from the end), so the generated
// launcher spells its arguments as it did with torch.
class TensorRef {
 public:
  TensorRef() = default;
  explicit TensorRef(TensorArg const* t) : t_(t) {}
  int64_t dim() const { return t_->dim; }
  int64_t size(int64_t i) const { return t_->sizes[i < 0 ? i + t_->dim : i]; }
  int64_t stride(int64_t i) const { return t_->strides[i < 0 ? i + t_->dim : i]; }
  void* data_ptr() const { return reinterpret_cast<void*>(t_->data); }
  template <class T>
  T* data_ptr() const { return static_cast<T*>(data_ptr()); }

 private:
  TensorArg const* t_ = nullptr;
};

// `count` tensors from `first` on (the operands or the outputs): indexed like a TensorList.
class TensorRefs {
 public:
  TensorRefs(TensorArg const* first, int64_t count) : first_(first), count_(count) {}
  TensorRef operator[](int64_t i) const { return TensorRef(first_ + i); }
  int64_t size() const { return count_; }

 private:
  TensorArg const* first_;
  int64_t count_;
};

// A failed check: its message goes back to the caller (coda_dsl raises it as a KernelError).
struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... Parts>
[[noreturn]] void fail(Parts const&... parts) {
  std::string s;
  ((s += parts), ...);
  throw Failure(s);
}

// The header of a call's block (six int64), followed by TensorArg[n_tensors] and double[n_scalars].
struct CallArgs {
  int64_t n_tensors;
  int64_t n_scalars;
  int64_t device;
  int64_t stream;     // the caller's current cudaStream_t on `device` (0 in a size query)
  int64_t workspace;  // from torch's caching allocator (0 in a size query, or when none is needed)
  int64_t workspace_size;
};
static_assert(sizeof(CallArgs) == 48, "the layout runtime/kernel.py packs");

// One call, unpacked: its arguments, and whether it only asks for the workspace size (nothing is
// launched then).
struct Call {
  TensorArg const* tensors;
  int64_t n_tensors;
  double const* scalars;
  int64_t n_scalars;
  int device;
  CUstream_st* stream;
  char* workspace;
  int64_t workspace_size;
  bool query;

  Call(CallArgs const* args, bool query)
      : tensors(reinterpret_cast<TensorArg const*>(args + 1)),
        n_tensors(args->n_tensors),
        scalars(reinterpret_cast<double const*>(tensors + args->n_tensors)),
        n_scalars(args->n_scalars),
        device(int(args->device)),
        stream(reinterpret_cast<CUstream_st*>(args->stream)),
        workspace(reinterpret_cast<char*>(args->workspace)),
        workspace_size(args->workspace_size),
        query(query) {}
};

// Buffers carved from the one workspace the caller allocates, 256-byte aligned: the kernel's own
// (per-tile partials), then CUTLASS's. In a size query nothing is written, only counted.
class Workspace {
 public:
  explicit Workspace(Call const& call) : call_(call) {}
  void* take(int64_t bytes) {  // null for 0 bytes, as CUTLASS gets when it needs no workspace
    if (bytes == 0) return nullptr;
    int64_t at = used_;
    used_ += (bytes + 255) / 256 * 256;
    if (!call_.query && used_ > call_.workspace_size)
      fail("coda_dsl: workspace of ", std::to_string(call_.workspace_size), " bytes is smaller than the ",
           std::to_string(used_), " this problem needs");
    return call_.query ? nullptr : call_.workspace + at;
  }
  float* floats(int64_t count) { return static_cast<float*>(take(count * int64_t(sizeof(float)))); }
  int64_t used() const { return used_; }

 private:
  Call const& call_;
  int64_t used_ = 0;
};

inline void write_message(char* message, int64_t size, char const* what) {
  if (!message || size <= 0) return;
  std::strncpy(message, what, size_t(size) - 1);
  message[size - 1] = '\0';
}

// Runs `body` for an extern "C" entry point: 0, or 1 with the failure's message in the caller's buffer.
template <class Body>
int guarded(char* message, int64_t message_size, Body&& body) noexcept {
  try {
    body();
    return 0;
  } catch (std::exception const& e) {
    write_message(message, message_size, e.what());
  } catch (...) {
    write_message(message, message_size, "unknown C++ exception");
  }
  return 1;
}

}  // namespace coda
