// Text handling the plan layer's two parsers share (`nvidia-smi topo -m` and tuning tables).
#pragma once

#include <string_view>

namespace pcie_ar::plan {

// `s` without leading and trailing blanks: spaces, tabs, \v, \f and the \r of CRLF files.
inline std::string_view trim(std::string_view s) {
  constexpr std::string_view kBlanks = " \t\v\f\r";
  const size_t first = s.find_first_not_of(kBlanks);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(kBlanks) - first + 1);
}

}  // namespace pcie_ar::plan
