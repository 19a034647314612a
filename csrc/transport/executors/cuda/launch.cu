// The only translation unit nvcc compiles: the nine executor instantiations (dtype × direction,
// and for push the decode-shaped one beside the large-message one: kernel_params.h),
// the P2P probe kernels, and the host functions that launch them (launch.h), with
// programmatic dependent launch where the workspace asks for it.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "transport/executors/cuda/executor.cuh"
#include "transport/executors/cuda/launch.h"
#include "transport/memory/cuda_device.h"

namespace pcie_ar::transport {
namespace {

using Kernel = void (*)(LaunchParams);

template <typename T>
Kernel kernel_of(plan::Direction direction, int threads) {
  using plan::Direction;
  if (executor_bound(direction, threads) == kDecodeThreads) {
    return kernels::executor_kernel<T, Direction::kPush, kDecodeThreads>;
  }
  return direction == Direction::kPush ? kernels::executor_kernel<T, Direction::kPush, kMaxThreads>
                                       : kernels::executor_kernel<T, Direction::kPull, kMaxThreads>;
}

// The instantiation a launch of `threads` threads per CTA runs (executor_bound).
Kernel kernel_for(plan::DType dtype, plan::Direction direction, int threads) {
  switch (dtype) {
    case plan::DType::kBF16:
      return kernel_of<__nv_bfloat16>(direction, threads);
    case plan::DType::kFP16:
      return kernel_of<__half>(direction, threads);
    case plan::DType::kFP32:
      return kernel_of<float>(direction, threads);
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

__global__ void probe_kernel(uint32_t* dst, uint32_t nonce, int src, int dst_rank) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < kProbeWords) dst[i] = probe_word(nonce, src, dst_rank, i);
}

// The pull kernels' own load (ld.global.cv of 16-byte vectors) of a peer's words.
__global__ void probe_read_kernel(const uint4* src, uint4* dst) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < kProbeWords / 4) dst[i] = kernels::load_cv(src + i);
}

[[noreturn]] void launch_executor_failed(const LaunchParams& p, cudaError_t err) {
  throw std::runtime_error(
      "launching the all-reduce executor (" + std::string(plan::dtype_name(p.dtype)) + ", " +
      std::string(plan::direction_name(p.direction)) + ", grid " + std::to_string(p.blocks) + "x" +
      std::to_string(p.ranks_in_launch) + ", " + std::to_string(p.threads) + " threads" +
      (p.pdl ? ", programmatic dependent launch" : "") + ") failed (" + cudaGetErrorName(err) +
      ": " + cudaGetErrorString(err) + ")");
}

cudaError_t launch_pdl(const void* kernel, const LaunchParams& p, cudaStream_t stream) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(p.blocks, p.ranks_in_launch);
  config.blockDim = dim3(p.threads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  void* args[] = {const_cast<LaunchParams*>(&p)};
  return cudaLaunchKernelExC(&config, kernel, args);
}

}  // namespace

bool launch_executor(const LaunchParams& p, cudaStream_t stream) {
  const void* kernel = reinterpret_cast<const void*>(kernel_for(p.dtype, p.direction, p.threads));
  void* args[] = {const_cast<LaunchParams*>(&p)};
  if (p.pdl) {
    const cudaError_t err = launch_pdl(kernel, p, stream);
    if (err == cudaSuccess) return true;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    const cudaError_t query = cudaStreamIsCapturing(stream, &capture);
    if (query != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
      launch_executor_failed(p, err);
    }
    cudaGetLastError();  // a refused launch is not sticky: clear it before the plain retry
    LaunchParams plain = p;
    plain.pdl = false;
    void* plain_args[] = {&plain};
    const cudaError_t retry = cudaLaunchKernel(kernel, dim3(p.blocks, p.ranks_in_launch),
                                               dim3(p.threads), plain_args, 0, stream);
    if (retry != cudaSuccess) launch_executor_failed(plain, retry);
    return false;
  }
  const cudaError_t err =
      cudaLaunchKernel(kernel, dim3(p.blocks, p.ranks_in_launch), dim3(p.threads), args, 0, stream);
  if (err != cudaSuccess) launch_executor_failed(p, err);
  return true;
}

bool executor_waits_for_previous_grid() {
  for (plan::DType dtype : plan::kAllDTypes) {
    for (plan::Direction direction : {plan::Direction::kPush, plan::Direction::kPull}) {
      for (int threads : {kDecodeThreads, kMaxThreads}) {  // both instantiations (executor_bound)
        cudaFuncAttributes attributes{};
        if (cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel_for(
                                                   dtype, direction, threads))) != cudaSuccess) {
          cudaGetLastError();
          return false;
        }
        if (attributes.ptxVersion < 90 || attributes.binaryVersion < 90) return false;
      }
    }
  }
  return true;
}

int executor_ctas_per_sm(plan::DType dtype, plan::Direction direction, int threads) {
  int per_sm = 0;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, reinterpret_cast<const void*>(kernel_for(dtype, direction, threads)), threads, 0);
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("cudaOccupancyMaxActiveBlocksPerMultiprocessor failed (") +
                             cudaGetErrorName(err) + ": " + cudaGetErrorString(err) + ")");
  }
  return per_sm;
}

bool pdl_enabled(int device) {
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
        "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
  return major >= 9 && executor_waits_for_previous_grid();
}

bool use_pdl(bool requested, int device) { return requested && pdl_enabled(device); }

cudaError_t launch_probe(uint32_t* dst, uint32_t nonce, int src, int dst_rank) {
  probe_kernel<<<1, kProbeWords>>>(dst, nonce, src, dst_rank);
  return cudaGetLastError();
}

cudaError_t launch_probe_read(const uint32_t* src, uint32_t* dst) {
  probe_read_kernel<<<1, kProbeWords / 4>>>(reinterpret_cast<const uint4*>(src),
                                            reinterpret_cast<uint4*>(dst));
  return cudaGetLastError();
}

}  // namespace pcie_ar::transport
