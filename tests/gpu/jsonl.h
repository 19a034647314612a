// One JSON line per measurement, appended to $PCIE_GPU_JSONL the moment it is taken
// (tests/gpu/quick.sh keeps the files; `python -m pcie_allreduce.tuning.refit` reads the
// microbenchmarks' lines and skips the others): a trap or a timeout later keeps everything
// written before it. Host code, shared by pcie_gpu_microbench and pcie_gpu_check.
#pragma once

#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>

namespace pcie_gpu {

// `fields` is the object's inside, printf-style (field names and string values are fixed words
// of the caller, never escaped); the line carries the program, the device (its name with any
// quote, backslash or control character replaced by '?', and sm_XY) and the bench.
inline void record(const char* program, const char* bench, const char* fields, ...)
    __attribute__((format(printf, 3, 4)));
inline void record(const char* program, const char* bench, const char* fields, ...) {
  static FILE* out = [] {
    const char* path = std::getenv("PCIE_GPU_JSONL");
    return path != nullptr && path[0] != '\0' ? std::fopen(path, "a") : nullptr;
  }();
  if (out == nullptr) return;
  static char device[320] = {};
  if (device[0] == '\0') {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
      std::snprintf(device, sizeof(device), "%.255s sm_%d%d", prop.name, prop.major, prop.minor);
      for (char* c = device; *c != '\0'; ++c) {
        if (*c == '"' || *c == '\\' || static_cast<unsigned char>(*c) < 0x20) *c = '?';
      }
    }
  }
  std::fprintf(out, "{\"program\": \"%s\", \"device\": \"%s\", \"bench\": \"%s\", ", program,
               device, bench);
  va_list args;
  va_start(args, fields);
  std::vfprintf(out, fields, args);
  va_end(args);
  std::fprintf(out, "}\n");
  std::fflush(out);
}

}  // namespace pcie_gpu
