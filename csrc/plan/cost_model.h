// The cost model: what one call of a schedule costs on a GPU host, in microseconds, from its
// step lists and a handful of constants. It walks every rank's program the way the CUDA executor
// runs it (one CTA's view; the CTAs of a launch run side by side) and adds up the latencies on
// the critical path (an alpha term), then the bytes on the busiest link over that link's
// bandwidth (a beta term):
//
//   modelled_us = launch + the longest chain of dependent latencies + busiest_link_bytes / GB/s
//
// The chain is what costs time on PCIe: a load whose result the next store or tag check waits
// for, a poll that sees a peer's data or flag land, a posted write crossing the fabric, a system
// fence. `serial_round_trips` counts those links of the chain, so two tactics can be compared
// without trusting any constant. The constants live here and nowhere else (docs/benchmarks.md,
// "The cost model", says where each one comes from); refit them from `pcie_gpu_microbench`
// whenever a GPU run happens. ExecutorModel says what the executor's code does with them (the
// SASS checks, tests/sass/, hold the code to it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/schedule.h"

namespace pcie_ar::plan {

// Where the workspaces (slots, LL slots, flags) live: each rank's GPU memory, peers reaching it
// over P2P (cuda_ipc), or pinned host DRAM that every GPU reaches over its own PCIe link
// (cuda_host; the generation counters stay in GPU memory there).
enum class Placement : uint8_t { kDeviceMemory = 0, kHostMemory = 1 };

// Latencies in microseconds, bandwidths in GB/s (1 GB/s moves 1,000 bytes per microsecond).
// Defaults: PCIe Gen5 x16 GPUs on two sockets, the kernel one node of a CUDA graph. "Published"
// values are physical facts from published measurements and vendor figures; "guess" values wait
// for `pcie_gpu_microbench` (docs/benchmarks.md, "The cost model").
struct LatencyModel {
  double launch_us = 0.6;               // a kernel node of a CUDA graph (published: about 0.6)
  double local_load_us = 0.3;           // a load or poll of this GPU's own L2 (guess)
  double posted_write_us = 0.45;        // store issued to visible in a peer (published 0.36-0.45)
  double posted_write_cross_us = 0.44;  // the same across the socket link (published 0.44)
  double peer_read_us = 2.2;            // a load of a peer's memory (published 2.1-2.3 at 4 GPUs)
  double peer_read_cross_us = 2.2;      // the same across sockets (not published apart: guess)
  double host_read_us = 1.5;            // a load or poll of pinned host DRAM (guess)
  double host_write_us = 0.5;           // store to host DRAM until another GPU can read it (guess)
  double fence_after_peer_writes_us = 2.5;   // fence.sc.sys with writes out on the fabric (guess)
  double fence_after_local_writes_us = 0.8;  // the same with only local writes pending (guess)
  double gpu_link_gbps = 44.8;               // one GPU's stores to one peer (published 44.8)
  double gpu_link_fanout_gbps = 25.4;        // to several peers in one stage (published 25.4)
  double socket_link_gbps = 23.75;  // one rank's flow across the socket link (published 23.75)
};

// What the executor's code does that the model cannot read from the step lists.
struct ExecutorModel {
  // Operands a thread takes at a time (kLLGroup in primitives_gpu.cuh: every operand in the
  // decode-shaped kernels, 2 in the large-message ones). A default-constructed model is the
  // large-message kernel's; current_executor() is what the seed's LL tactics run.
  int first_look_group = 2;
  // The same for Lamport operands (kLLDenseGroup: as kLLGroup, but 4 in the large-message
  // kernels on sm_100 and sm_120).
  int dense_first_look_group = 4;
  // True when a group's loads all issue before its first tag compare; false when each LL
  // operand's compare waits for its own load before the next operand's load issues (every LL
  // operand then ends a wave: one more round trip per vector).
  bool parallel_first_look = true;
  // True when a look after a miss re-loads every missing operand of the group at once; false
  // when the missing ones are awaited one at a time, in operand order (one more look each).
  bool parallel_relooks = false;
  // Consecutive copies of one chunk of this rank's input or output to several destinations of
  // one kind load it once (the executor's fan-out); false: each copy re-loads its source and
  // waits for it before it stores.
  bool multi_destination_copies = false;
};

// The executor as it is built today (csrc/transport/executors/cuda/executor.cuh).
ExecutorModel current_executor();

struct CostReport {
  double modelled_us = 0.0;
  double latency_us = 0.0;    // the critical path, launch included
  double bandwidth_us = 0.0;  // busiest_link_bytes over that link's bandwidth
  int serial_round_trips = 0;
  double busiest_link_bytes = 0.0;  // LL counts its tags: twice the payload
  std::string busiest_link;         // "rank 3 out", "rank 0 in", "rank 5 across socket 1->0"
  // The critical path, one entry per link of the chain: "rank 1 step 2: look at LL from rank 0
  // (local load 0.30)".
  std::vector<std::string> critical_path;
};

// The model of one call of `nbytes` (the whole message). The schedule must have passed verify().
CostReport model_cost(const Schedule& schedule, int64_t nbytes, Placement placement,
                      const LatencyModel& latency = {},
                      const ExecutorModel& executor = current_executor());

}  // namespace pcie_ar::plan
