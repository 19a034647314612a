// What a communicator is made with: the group (rank, world, islands), the workspace's size and
// transport, the table, and why it is off, if it is.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/decline.h"
#include "plan/layout.h"
#include "plan/tactic.h"
#include "transport/kind.h"

namespace pcie_ar::comm {

struct Options {
  int rank = 0;
  int world = 0;
  int64_t max_numel = 0;
  // An all-reduce or fused call larger than the workspace, up to this many elements, runs on the
  // kernels as rounds through it (plan/rounds.h); above it, or when 0, it declines too_large.
  int64_t stream_max_numel = 0;
  std::vector<plan::DType> dtypes = {plan::DType::kBF16, plan::DType::kFP16, plan::DType::kFP32};
  transport::Kind transport = transport::Kind::kHostShm;
  int device = -1;                           // CUDA device index (CUDA transports)
  double timeout_s = 30.0;                   // every wait's deadline; 0 = forever
  uint32_t initial_gen = 0;                  // tests start near 2^32 to cross the wrap
  int max_blocks = plan::kDefaultMaxBlocks;  // a transport may cap it (host_shm: 8)
  // What the table's topology column matches; the legacy keys host and hostmem mean host_shm
  // and cuda_host (plan::canonical_topology_key), as in the table itself.
  std::string topology_key = "flat";
  std::vector<int> island_of;  // rank -> island; empty = flat
  std::string table_text;      // CSV; empty = the embedded seed table
  std::string table_source = "embedded seed table";
  std::string group_name;             // c10d group the fallback runs on
  Decline disabled = Decline::kNone;  // set when the backend must not run (handshake, NVLink)
  std::string disabled_detail;
  int log_level = 1;  // 0 silent, 1 one line per decline reason and skipped row, 2 verbose
  bool pdl = true;    // CUDA transports: programmatic dependent launch where the GPU allows it
};

// One line on stderr, "[pcie_allreduce] rank R: message", when options.log_level >= level.
void log(const Options& options, int level, const std::string& message);

}  // namespace pcie_ar::comm
