// The CUDA runtime calls the launchers share (the generated kernel's and the finishing kernels'):
// checked, with the op's name in the message.
#pragma once

#include <cuda_runtime.h>

#include "coda_dsl/abi.h"

namespace coda {

inline void check_cuda(cudaError_t e, char const* op_name, char const* what) {
  if (e != cudaSuccess) fail(op_name, ": ", what, " failed: ", cudaGetErrorString(e));
}

// The call's device is current while it runs (its kernels launch there); the caller's is restored.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "coda_dsl", "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "coda_dsl", "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(DeviceGuard const&) = delete;
  DeviceGuard& operator=(DeviceGuard const&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace coda
