// Ranks as threads of one process: one Communicator per rank over the host transport (each maps
// its peers' shared memory), connected as the Python bootstrap connects them, each rank's calls on
// its own thread. No process group: these suites run the kernel path and everything that decides
// it; the group's own collectives are tested from Python with real gloo groups.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/zeros_like.h>

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"

namespace pcie_ar::comm::test {

class CommGroup {
 public:
  CommGroup(int world, const std::string& table, int64_t max_numel, std::vector<int> island_of = {},
            int64_t stream_max_numel = 0) {
    for (int r = 0; r < world; ++r) {
      Options o;
      o.rank = r;
      o.world = world;
      o.max_numel = max_numel;
      o.stream_max_numel = stream_max_numel;
      o.table_text = table;
      o.table_source = "test table";
      o.island_of = island_of;
      o.topology_key = island_of.empty() ? "flat" : "islands";
      o.log_level = 0;
      o.timeout_s = 30;
      ranks_.push_back(std::make_unique<Communicator>(o));
    }
    std::vector<std::string> tokens;
    for (auto& c : ranks_) tokens.push_back(c->local_token());
    for (auto& c : ranks_) c->connect(tokens);
    for (auto& c : ranks_) c->retire_token();
  }
  ~CommGroup() {
    for (auto& c : ranks_) c->close_peers();
    for (auto& c : ranks_) c->release();
  }
  CommGroup(const CommGroup&) = delete;
  CommGroup& operator=(const CommGroup&) = delete;

  int world() const { return static_cast<int>(ranks_.size()); }
  Communicator& operator[](int rank) { return *ranks_[rank]; }

  // fn(rank, communicator) on one thread per rank, as ranks call; rethrows the first failure.
  void each(const std::function<void(int, Communicator&)>& fn) {
    std::vector<std::exception_ptr> errors(ranks_.size());
    std::vector<std::thread> threads;
    for (int r = 0; r < world(); ++r) {
      threads.emplace_back([&, r] {
        try {
          fn(r, *ranks_[r]);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }

 private:
  std::vector<std::unique_ptr<Communicator>> ranks_;
};

// Rank r's input: a smooth function of (r, index), distinct on every rank and element.
inline at::Tensor rank_input(int rank, int64_t numel, at::ScalarType dtype, double seed = 0.0) {
  const at::Tensor i = at::arange(numel, at::kDouble);
  return at::sin(i * 0.37 + rank * 1.3 + seed).mul(3.0).to(dtype);
}

}  // namespace pcie_ar::comm::test
