// The tuning table: first matching runnable row wins, boundaries are [min, max), rows that
// cannot run are skipped with a reason, and malformed text is rejected naming the line.
#include <gtest/gtest.h>

#include <string>

#include "plan/schedule.h"
#include "plan/tuning_table.h"

namespace pcie_ar::plan {
namespace {

constexpr std::string_view kTable = R"(# comment
topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,threads
islands-2x4,8,bf16,0,65536,island_oneshot,push,1,16,256
islands-2x4,8,bf16,65536,1048576,island_twoshot,pull,1,4,512   # trailing comment
*,2,*,0,*,oneshot,push,0,16,128
*,*,*,0,*,fallback,,,,
)";

TableChoice pick(const TuningTable& t, std::string_view topo, int world, DType d, int64_t bytes) {
  return t.choose(topo, world, d, bytes, nullptr);
}

TEST(TuningTable, MinBytesIsInclusiveAndMaxBytesExclusive) {
  const TuningTable t = TuningTable::parse(kTable);
  EXPECT_EQ(pick(t, "islands-2x4", 8, DType::kBF16, 0).tactic.algorithm, Algorithm::kIslandOneshot);
  EXPECT_EQ(pick(t, "islands-2x4", 8, DType::kBF16, 65535).tactic.algorithm,
            Algorithm::kIslandOneshot);
  const TableChoice at = pick(t, "islands-2x4", 8, DType::kBF16, 65536);
  EXPECT_FALSE(at.fallback);
  EXPECT_EQ(at.tactic.algorithm, Algorithm::kIslandTwoshot);
  EXPECT_EQ(at.tactic.direction, Direction::kPull);
  EXPECT_EQ(at.tactic.blocks, 4);
  EXPECT_EQ(at.tactic.threads, 512);
  EXPECT_EQ(at.line, 4);
  EXPECT_TRUE(pick(t, "islands-2x4", 8, DType::kBF16, 1048576).fallback);
}

TEST(TuningTable, WildcardsAndFirstMatchWin) {
  const TuningTable t = TuningTable::parse(kTable);
  // fp16 does not match the bf16 rows; world 8 does not match the world-2 row.
  EXPECT_TRUE(pick(t, "islands-2x4", 8, DType::kFP16, 100).fallback);
  const TableChoice two = pick(t, "anything", 2, DType::kFP32, 1 << 30);
  EXPECT_FALSE(two.fallback);
  EXPECT_EQ(two.tactic.algorithm, Algorithm::kOneshot);
  EXPECT_FALSE(two.tactic.staged);
}

TEST(TuningTable, NoMatchMeansFallback) {
  const TuningTable t = TuningTable::parse("islands-2x4,8,bf16,0,1024,oneshot,push,1,1,64\n");
  const TableChoice c = pick(t, "flat", 4, DType::kBF16, 16);
  EXPECT_TRUE(c.fallback);
  EXPECT_EQ(c.line, 0);
}

TEST(TuningTable, SkipsRowsThatCannotRunAndKeepsMatching) {
  const TuningTable t = TuningTable::parse(
      "*,*,*,0,*,island_twoshot,push,1,8,256\n"
      "*,*,*,0,*,warpspeed,push,1,8,256\n"
      "*,*,*,0,*,twoshot,push,1,8,256\n");
  const std::vector<int> flat;
  const TableChoice c = t.choose("flat", 8, DType::kBF16, 4096, [&](const TableRow& row, int64_t) {
    return why_unsupported(row.tactic, 8, flat);
  });
  EXPECT_FALSE(c.fallback);
  EXPECT_EQ(c.tactic.algorithm, Algorithm::kTwoshot);
  ASSERT_EQ(c.skipped.size(), 2u);
  EXPECT_EQ(c.skipped[0].first, 1);
  EXPECT_NE(c.skipped[0].second.find("flat"), std::string::npos) << c.skipped[0].second;
  EXPECT_EQ(c.skipped[1].first, 2);
  EXPECT_NE(c.skipped[1].second.find("unknown algorithm 'warpspeed'"), std::string::npos);
}

std::string parse_error(std::string_view text);

TEST(TuningTable, HashIgnoresCommentsSpacingAndMeasuredColumns) {
  const TuningTable a = TuningTable::parse("*,2,*,0,*,oneshot,push,0,16,128\n");
  const TuningTable b =
      TuningTable::parse("# x\n *, 2,*,0,*,oneshot,push,0,16,128, flag ,5.1,7.9\n");
  const TuningTable c = TuningTable::parse("*,2,*,0,*,oneshot,push,0,16,256\n");
  const TuningTable d = TuningTable::parse("*,2,*,0,*,oneshot,push,0,16,128,,5.1\n");
  EXPECT_EQ(a.hash(), b.hash());  // flag is the default: ten-column tables keep their hash
  EXPECT_EQ(a.hash(), d.hash());
  EXPECT_NE(a.hash(), c.hash());
  ASSERT_EQ(b.rows()[0].extra.size(), 2u);
  EXPECT_EQ(b.rows()[0].extra[1], "7.9");
}

TEST(TuningTable, ReadsTheProtocolColumnAndChecksEachSize) {
  const TuningTable t = TuningTable::parse(
      "topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,threads,"
      "protocol\n"
      "*,*,*,0,65536,oneshot,push,0,4,128,ll\n"
      "*,*,*,0,*,oneshot,push,1,8,256\n");
  EXPECT_EQ(t.rows()[0].tactic.protocol, Protocol::kLL);
  EXPECT_EQ(t.rows()[1].tactic.protocol, Protocol::kFlag);
  EXPECT_NE(t.hash(), TuningTable::parse("*,*,*,0,65536,oneshot,push,0,4,128\n"
                                         "*,*,*,0,*,oneshot,push,1,8,256\n")
                          .hash());
  // The check sees the size: an LL row too small for a message is skipped for that size only.
  const auto capacity = [](const TableRow& row, int64_t bytes) -> std::optional<std::string> {
    if (row.tactic.protocol == Protocol::kLL && bytes > 8192) return "too big for LL";
    return std::nullopt;
  };
  EXPECT_EQ(t.choose("flat", 4, DType::kBF16, 8192, capacity).tactic.protocol, Protocol::kLL);
  const TableChoice big = t.choose("flat", 4, DType::kBF16, 16384, capacity);
  EXPECT_EQ(big.tactic.protocol, Protocol::kFlag);
  ASSERT_EQ(big.skipped.size(), 1u);
  EXPECT_EQ(big.skipped[0].second, "too big for LL");
  EXPECT_NE(parse_error("*,*,*,0,*,oneshot,push,0,4,128,lowlat\n")
                .find("column protocol must be "
                      "flag or ll"),
            std::string::npos);
}

std::string parse_error(std::string_view text) {
  try {
    TuningTable::parse(text, "my.csv");
  } catch (const TableError& e) {
    return e.what();
  }
  return "accepted";
}

TEST(TuningTable, RejectsMalformedRowsNamingTheLine) {
  EXPECT_EQ(parse_error("\n*,2,*,0\n"),
            "my.csv line 2: expected 10 columns (topology,world,dtype,min_bytes,max_bytes,"
            "algorithm,direction,staged,blocks,threads), found 4");
  EXPECT_NE(parse_error("*,two,*,0,*,fallback\n").find("line 1: column world"), std::string::npos);
  EXPECT_NE(parse_error("*,2,bf8,0,*,fallback\n").find("column dtype"), std::string::npos);
  EXPECT_NE(parse_error("*,2,*,10,5,fallback\n").find("must exceed min_bytes"), std::string::npos);
  EXPECT_NE(parse_error("*,2,*,0,*,oneshot,sideways,1,1,64\n").find("push or pull"),
            std::string::npos);
  EXPECT_NE(parse_error("*,2,*,0,*,oneshot,push,2,1,64\n").find("staged must be 0 or 1"),
            std::string::npos);
  EXPECT_NE(parse_error("*,2,*,0,*,oneshot,push,1,0,64\n").find("blocks"), std::string::npos);
  EXPECT_NE(parse_error("topology,world\n").find("header"), std::string::npos);
}

TEST(TuningTable, EmbeddedSeedParsesAndSendsNvlinkToTheFallback) {
  const TuningTable t = TuningTable::embedded();
  EXPECT_GT(t.rows().size(), 5u);
  EXPECT_TRUE(pick(t, "nvlink", 8, DType::kBF16, 4096).fallback);
  const TableChoice small = pick(t, "islands-2x4", 8, DType::kBF16, 12288);
  EXPECT_FALSE(small.fallback);
  EXPECT_EQ(small.tactic.algorithm, Algorithm::kIslandOneshot);
  EXPECT_EQ(small.tactic.protocol, Protocol::kLL);  // decode sizes: flag-in-data
  const TableChoice mid = pick(t, "islands-2x4", 8, DType::kBF16, 64 * 1024);
  EXPECT_EQ(mid.tactic.protocol, Protocol::kFlag);
  EXPECT_FALSE(mid.tactic.staged);
  // Every tactic row of the seed builds and verifies for the worlds it names.
  for (const TableRow& row : t.rows()) {
    if (row.fallback || row.world < 0) continue;
    const std::vector<int> halves = [&] {
      std::vector<int> island_of(row.world);
      for (int r = 0; r < row.world; ++r) island_of[r] = r < row.world / 2 ? 0 : 1;
      return island_of;
    }();
    EXPECT_FALSE(why_unsupported(row.tactic, row.world, halves).has_value()) << "line " << row.line;
  }
  EXPECT_EQ(pick(t, "islands-2x4", 8, DType::kBF16, 384 * 1024).tactic.algorithm,
            Algorithm::kIslandTwoshot);
  EXPECT_EQ(pick(t, "flat", 4, DType::kFP16, 4096).tactic.algorithm, Algorithm::kOneshot);
  EXPECT_EQ(pick(t, "host", 4, DType::kFP32, 1 << 20).tactic.algorithm, Algorithm::kTwoshot);
}

}  // namespace
}  // namespace pcie_ar::plan
