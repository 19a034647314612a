// Enum names from one table (plan/names.h), and the transport vocabulary built on it
// (transport/kind.h): canonical names out, canonical names and aliases in.
#include <gtest/gtest.h>

#include <array>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "plan/names.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "transport/kind.h"

namespace pcie_ar {
namespace {

enum class Fruit : uint8_t { kApple = 0, kPear = 1, kFig = 2 };
constexpr auto kFruitNames = plan::name_table<Fruit>(
    "fruit", {{Fruit::kApple, "apple", {"malus"}}, {Fruit::kPear, "pear"}, {Fruit::kFig, "fig"}});

std::string parse_error(std::string_view name) {
  try {
    kFruitNames.parse(name);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(Names, OneTableNamesParsesAndListsEveryValue) {
  static_assert(kFruitNames.name_of(Fruit::kPear) == "pear");
  static_assert(kFruitNames.find("malus") == Fruit::kApple);  // aliases parse, never print
  EXPECT_EQ(kFruitNames.name_of(static_cast<Fruit>(9)), "?");
  EXPECT_EQ(kFruitNames.name_of(static_cast<Fruit>(9), "unknown"), "unknown");
  EXPECT_FALSE(kFruitNames.find("").has_value());  // an empty alias slot matches nothing
  EXPECT_FALSE(kFruitNames.find("Apple").has_value());
  EXPECT_EQ(kFruitNames.parse("fig"), Fruit::kFig);
  EXPECT_EQ(kFruitNames.list(), "apple, pear, fig");
  EXPECT_EQ(kFruitNames.list(" or "), "apple, pear or fig");
  EXPECT_EQ(kFruitNames.names(), (std::vector<std::string_view>{"apple", "pear", "fig"}));
  EXPECT_EQ(kFruitNames.aliases_of(Fruit::kApple), std::vector<std::string_view>{"malus"});
  EXPECT_TRUE(kFruitNames.aliases_of(Fruit::kPear).empty());
  EXPECT_EQ(parse_error("kiwi"),
            "fruit: expected one of apple, pear, fig (aliases: malus = apple), got 'kiwi'");
  EXPECT_EQ(kFruitNames.must_be("kiwi"), "fruit must be apple, pear or fig, got 'kiwi'");
  static_assert(kFruitNames.values() == std::array{Fruit::kApple, Fruit::kPear, Fruit::kFig});
}

TEST(Names, TransportsHaveTheirFilesNamesAndTheOldNamesAsAliases) {
  using transport::Kind;
  using transport::kKindNames;
  EXPECT_EQ(kKindNames.names(),
            (std::vector<std::string_view>{"host_shm", "cuda_ipc", "cuda_host"}));
  for (const Kind kind : {Kind::kHostShm, Kind::kCudaIpc, Kind::kCudaHost}) {
    EXPECT_EQ(kKindNames.find(kKindNames.name_of(kind)), kind);
  }
  EXPECT_EQ(kKindNames.parse("host"), Kind::kHostShm);
  EXPECT_EQ(kKindNames.parse("cuda"), Kind::kCudaIpc);
  EXPECT_EQ(kKindNames.parse("p2p"), Kind::kCudaIpc);
  EXPECT_EQ(kKindNames.parse("hostmem"), Kind::kCudaHost);
  EXPECT_EQ(kKindNames.aliases_of(Kind::kCudaIpc), (std::vector<std::string_view>{"cuda", "p2p"}));
  EXPECT_THROW(kKindNames.parse("nvlink"), std::invalid_argument);
}

// The names Python sees in diagnostics (kind) and step lists (kind, space): one per value, in
// the enums' order, each parsing back.
TEST(Names, DiagnosticsAndStepsNameEveryValue) {
  EXPECT_EQ(plan::kFailureKindNames.names(),
            (std::vector<std::string_view>{"none", "timeout", "mismatch", "ll_timeout",
                                           "ll_mismatch", "interrupted", "fallback_timeout"}));
  EXPECT_EQ(plan::kStepKindNames.names(),
            (std::vector<std::string_view>{"reduce", "signal", "wait", "epilogue"}));
  EXPECT_EQ(plan::kSpaceNames.names(),
            (std::vector<std::string_view>{"input", "output", "slot", "ll"}));
  for (size_t i = 0; i < plan::kFailureKindNames.entries.size(); ++i) {
    EXPECT_EQ(static_cast<size_t>(plan::kFailureKindNames.entries[i].value), i);
  }
  for (size_t i = 0; i < plan::kStepKindNames.entries.size(); ++i) {
    EXPECT_EQ(static_cast<size_t>(plan::kStepKindNames.entries[i].value), i);
  }
  for (size_t i = 0; i < plan::kSpaceNames.entries.size(); ++i) {
    EXPECT_EQ(static_cast<size_t>(plan::kSpaceNames.entries[i].value), i);
  }
  EXPECT_EQ(plan::kFailureKindNames.name_of(static_cast<plan::FailureKind>(77), "unknown"),
            "unknown");
}

}  // namespace
}  // namespace pcie_ar
