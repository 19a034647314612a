// The verifier's symbolic values: hash-consed sum expressions over the ranks' inputs. Internal to
// the verifier (verify.cc and the verify_*.cc files); not part of the plan library's API.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace pcie_ar::plan::verifier {

// Hash-consed sum expressions: the leaves are the ranks' inputs, leaf round * world + q rank q's
// input in round `round` (every round of a streamed message has its own part of the tensors, so
// data another round left behind is a different expression); a sum node is an ordered list of
// operand ids, rounded once to the dtype. Two ranks, or two tactics, computing the same id
// compute the same bits.
class Expressions {
 public:
  Expressions(int world, int rounds) : world_(world), rounds_(rounds), leaves_(world * rounds) {}

  int num_leaves() const { return leaves_; }

  int sum(const std::vector<int>& operands) {
    if (operands.size() == 1) return operands[0];  // a copy is exact
    auto [it, inserted] = ids_.try_emplace(operands, leaves_ + static_cast<int>(nodes_.size()));
    if (inserted) nodes_.push_back(operands);
    return it->second;
  }

  void count_leaves(int id, std::vector<int>& counts) const {
    if (id < leaves_) {
      ++counts[id];
      return;
    }
    for (int child : nodes_[id - leaves_]) count_leaves(child, counts);
  }

  // Rank q's input: xq, or xq@k for round k's when the message has several rounds.
  std::string leaf_text(int leaf) const {
    const std::string rank = "x" + std::to_string(leaf % world_);
    return rounds_ > 1 ? rank + "@" + std::to_string(leaf / world_) : rank;
  }

  std::string text(int id) const {
    if (id < 0) return "nothing";
    if (id < leaves_) return leaf_text(id);
    std::string out = "(";
    const auto& children = nodes_[id - leaves_];
    for (size_t i = 0; i < children.size(); ++i) out += (i ? "+" : "") + text(children[i]);
    return out + ")";
  }

 private:
  int world_;
  int rounds_;
  int leaves_;
  std::map<std::vector<int>, int> ids_;
  std::vector<std::vector<int>> nodes_;
};

}  // namespace pcie_ar::plan::verifier
