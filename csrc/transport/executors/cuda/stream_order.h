// Orders one rank's eager calls across streams. Calls of one rank are ordered by the stream they
// are enqueued on; two calls running at once would read the same generation. So when a call
// arrives on a different stream than the last eager call, the new stream waits for everything
// enqueued on the previous one (an event, recorded at the switch). Under CUDA-graph capture
// nothing is ordered: the stream a graph is replayed on, and what else runs beside it, are the
// caller's responsibility, exactly as for any captured kernel. The previous stream must still
// exist when the switch happens.
#pragma once

#include <cuda_runtime_api.h>

namespace pcie_ar::transport {

// Not thread-safe, like the workspace that owns it.
class StreamOrder {
 public:
  StreamOrder() = default;
  ~StreamOrder();
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;

  // Before a call is enqueued on `stream` (the owner's device current): if the last eager call
  // went to another stream, `stream` waits for it. Nothing happens on the same stream, and
  // nothing while either stream is capturing.
  void before_call(cudaStream_t stream);

 private:
  cudaStream_t last_ = nullptr;
  bool have_last_ = false;
  cudaEvent_t event_ = nullptr;
};

}  // namespace pcie_ar::transport
