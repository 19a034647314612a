// What both fuzz targets assert beyond "no crash": a broken invariant aborts, so libFuzzer
// saves the input like any other crash.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace pcie_ar::fuzz {

inline void check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz: invariant broken: %s\n", what);
  std::abort();
}

// Error messages reach Python, which decodes them as strict UTF-8: a message quoting raw bytes
// of a binary input would turn a clear ValueError into a UnicodeDecodeError. Control bytes
// other than tab and newline would garble a terminal.
inline bool is_clean_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if ((c < 0x20 && c != '\t' && c != '\n') || c == 0x7F) return false;
      ++i;
      continue;
    }
    const size_t n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
    if (n == 0 || c > 0xF4 || n > s.size() - i) return false;
    const auto b1 = static_cast<unsigned char>(s[i + 1]);
    if ((c == 0xE0 && b1 < 0xA0) || (c == 0xED && b1 > 0x9F) || (c == 0xF0 && b1 < 0x90) ||
        (c == 0xF4 && b1 > 0x8F)) {
      return false;
    }
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

}  // namespace pcie_ar::fuzz
