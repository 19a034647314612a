// Enum names from one table per enum: the name of a value, the parser (canonical names and
// aliases) and the list an error message offers all read the same constexpr table, so they
// cannot drift apart. Pure C++20.
//
//   inline constexpr auto kDirectionNames = name_table<Direction>(
//       "direction", {{Direction::kPush, "push"}, {Direction::kPull, "pull"}});
//   kDirectionNames.name_of(Direction::kPull)  // "pull"
//   kDirectionNames.find("push")               // Direction::kPush; std::nullopt if unknown
//   kDirectionNames.parse("up")                // throws "direction: expected one of push,
//                                              //   pull, got 'up'"
//   kDirectionNames.list(" or ")               // "push or pull", for hand-written messages
//   kDirectionNames.values()                   // {kPush, kPull}, to loop over every value
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace pcie_ar::plan {

inline constexpr size_t kMaxAliases = 3;

// One value: the name name_of() gives it, and other names the parser also accepts.
template <typename E>
struct EnumName {
  E value;
  std::string_view name;
  std::array<std::string_view, kMaxAliases> aliases{};  // unused entries stay empty
};

template <typename E, size_t N>
struct NameTable {
  std::string_view what;  // what the names name, for errors: "transport"
  std::array<EnumName<E>, N> entries;

  // The canonical name of `value`; `unknown` for a value the table does not list.
  constexpr std::string_view name_of(E value, std::string_view unknown = "?") const {
    for (const EnumName<E>& e : entries) {
      if (e.value == value) return e.name;
    }
    return unknown;
  }

  // The value `name` names (canonical or alias), or std::nullopt.
  constexpr std::optional<E> find(std::string_view name) const {
    for (const EnumName<E>& e : entries) {
      if (e.name == name) return e.value;
      for (const std::string_view alias : e.aliases) {
        if (!alias.empty() && alias == name) return e.value;
      }
    }
    return std::nullopt;
  }

  // find(), or std::invalid_argument "<what>: expected one of a, b, c, got 'x'" (with an
  // aliases clause when the table has aliases).
  E parse(std::string_view name) const {
    if (const std::optional<E> value = find(name)) return *value;
    std::string aliases;
    for (const EnumName<E>& e : entries) {
      for (const std::string_view alias : e.aliases) {
        if (alias.empty()) continue;
        aliases += (aliases.empty() ? " (aliases: " : ", ") + std::string(alias) + " = " +
                   std::string(e.name);
      }
    }
    if (!aliases.empty()) aliases += ")";
    throw std::invalid_argument(std::string(what) + ": expected one of " + list() + aliases +
                                ", got '" + std::string(name) + "'");
  }

  // "<what> must be a, b or c, got 'x'": the message of the hand-written parsers these tables
  // replaced, kept where callers and tests know it.
  std::string must_be(std::string_view got) const {
    return std::string(what) + " must be " + list(" or ") + ", got '" + std::string(got) + "'";
  }

  // The canonical names in table order: "a, b, c"; list(" or ") gives "a, b or c".
  std::string list(std::string_view last_separator = ", ") const {
    std::string out;
    for (size_t i = 0; i < N; ++i) {
      if (i > 0) out += i + 1 == N ? last_separator : std::string_view(", ");
      out += entries[i].name;
    }
    return out;
  }

  // Every value, in table order (for loops over all of them).
  constexpr std::array<E, N> values() const {
    std::array<E, N> out{};
    for (size_t i = 0; i < N; ++i) out[i] = entries[i].value;
    return out;
  }

  std::vector<std::string_view> names() const {
    std::vector<std::string_view> out;
    for (const EnumName<E>& e : entries) out.push_back(e.name);
    return out;
  }

  std::vector<std::string_view> aliases_of(E value) const {
    std::vector<std::string_view> out;
    for (const EnumName<E>& e : entries) {
      if (e.value != value) continue;
      for (const std::string_view alias : e.aliases) {
        if (!alias.empty()) out.push_back(alias);
      }
    }
    return out;
  }
};

// name_table<E>("what", {{E::kA, "a"}, {E::kB, "b", {"bee"}}}): N is counted for you.
template <typename E, size_t N>
constexpr NameTable<E, N> name_table(std::string_view what, const EnumName<E> (&entries)[N]) {
  NameTable<E, N> table{what, {}};
  for (size_t i = 0; i < N; ++i) table.entries[i] = entries[i];
  return table;
}

}  // namespace pcie_ar::plan
