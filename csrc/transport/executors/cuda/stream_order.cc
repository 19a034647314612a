// How one rank's eager calls are ordered across streams; see stream_order.h.
#include "transport/executors/cuda/stream_order.h"

#include <cuda_runtime.h>

#include "transport/memory/cuda_device.h"

namespace pcie_ar::transport {
namespace {

bool capturing(cudaStream_t stream, bool* known) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  *known = err == cudaSuccess;
  if (!*known) cudaGetLastError();  // not sticky; leave nothing for the caller's next call
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

StreamOrder::~StreamOrder() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

void StreamOrder::before_call(cudaStream_t stream) {
  if (have_last_ && stream == last_) return;  // the common case costs nothing
  bool known = false;
  // A captured call is not ordered, and does not count as the last eager call.
  if (capturing(stream, &known) || !known) return;
  if (have_last_) {
    // Recording into a stream that is capturing now would join its graph; skip it then.
    const bool last_capturing = capturing(last_, &known);
    if (known && !last_capturing) {
      if (event_ == nullptr) {
        check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming),
              "creating the all-reduce stream-order event");
      }
      check(cudaEventRecord(event_, last_), "recording the previous all-reduce stream");
      check(cudaStreamWaitEvent(stream, event_, 0),
            "ordering the all-reduce after the previous stream's calls");
    }
  }
  last_ = stream;
  have_last_ = true;
}

}  // namespace pcie_ar::transport
