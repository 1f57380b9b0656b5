// kernels/visibility.h: the page-level answers agree with the key-level rule they summarise, on random
// page tables and query tiles (several sequences, partial pages, causal and not).
#include "kernels/visibility.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace kvpack {
namespace {

constexpr int kTrials = 4000;
constexpr int kTileRows = 128;

struct Tile {
  std::vector<int32_t> seq;   // per query row
  std::vector<int64_t> pos;   // consecutive tokens, as kernels' tiles are
};

Tile RandomTile(std::mt19937_64& rng) {
  Tile t;
  const int64_t first = std::uniform_int_distribution<int64_t>(0, 1000)(rng);
  int32_t s = std::uniform_int_distribution<int32_t>(0, 3)(rng);
  for (int r = 0; r < kTileRows; ++r) {
    if (std::uniform_int_distribution<int>(0, 90)(rng) == 0) ++s;  // a sequence boundary inside the tile
    t.seq.push_back(s);
    t.pos.push_back(first + r);
  }
  return t;
}

PageDesc RandomPage(std::mt19937_64& rng) {
  PageDesc p{};
  p.token_begin = std::uniform_int_distribution<int32_t>(0, 1200)(rng);
  p.seq_id = std::uniform_int_distribution<int32_t>(0, 5)(rng);
  p.n_valid = static_cast<uint16_t>(std::uniform_int_distribution<int>(1, 64)(rng) > 40 ? kPageTokens
                                                                                         : std::uniform_int_distribution<int>(1, 64)(rng));
  return p;
}

TEST(Visibility, PageAnswersSummariseTheKeyRule) {
  std::mt19937_64 rng(0x76697369);
  for (int trial = 0; trial < kTrials; ++trial) {
    const Visibility vis{trial % 2 == 1};
    const Tile tile = RandomTile(rng);
    const PageDesc page = RandomPage(rng);
    bool any = false, all = true;
    for (int r = 0; r < kTileRows; ++r) {
      for (int j = 0; j < kPageTokens; ++j) {
        const bool v = vis.KeyVisible(page, j, tile.seq[r], tile.pos[r]);
        any = any || v;
        all = all && v;
      }
    }
    // The tile's runs of equal sequence id, as QueryRuns builds them.
    bool visited = false, one_sequence = true;
    for (int r = 0; r < kTileRows; ++r) {
      const bool last_of_run = r + 1 == kTileRows || tile.seq[r + 1] != tile.seq[r];
      if (last_of_run) visited = visited || vis.PageVisibleToRun(page, tile.seq[r], tile.pos[r]);
      one_sequence = one_sequence && tile.seq[r] == tile.seq[0];
    }
    ASSERT_EQ(visited, any) << "trial " << trial;  // visited exactly when some query sees some key
    if (visited && !vis.PageNeedsMask(page, one_sequence, tile.pos[0])) {
      ASSERT_TRUE(all) << "trial " << trial << ": unmasked page with a hidden key";
    }
  }
}

// The routed policy pools a page for a block only when every valid key is visible to every query
// of the block (one sequence, consecutive positions).
TEST(Visibility, FullyVisibleToBlockMeansEveryKeyForEveryQuery) {
  std::mt19937_64 rng(0x726f757465);
  for (int trial = 0; trial < kTrials; ++trial) {
    const Visibility vis{trial % 2 == 1};
    const PageDesc page = RandomPage(rng);
    const int32_t seq = std::uniform_int_distribution<int32_t>(0, 5)(rng);
    const int64_t first = std::uniform_int_distribution<int64_t>(0, 1300)(rng);
    const int n = std::uniform_int_distribution<int>(1, kPageTokens)(rng);
    bool all = true;
    for (int r = 0; r < n; ++r) {
      for (int j = 0; j < page.n_valid; ++j) all = all && vis.KeyVisible(page, j, seq, first + r);
    }
    ASSERT_EQ(vis.PageFullyVisibleToBlock(page, seq, first), all) << "trial " << trial;
  }
}

TEST(Visibility, CausalHidesOnlyFutureKeys) {
  PageDesc page{};
  page.token_begin = 100, page.seq_id = 2, page.n_valid = 40;
  const Visibility causal{true}, dense{false};
  EXPECT_TRUE(causal.KeyVisible(page, 5, 2, 105));
  EXPECT_FALSE(causal.KeyVisible(page, 6, 2, 105));
  EXPECT_TRUE(dense.KeyVisible(page, 39, 2, 0));
  EXPECT_FALSE(dense.KeyVisible(page, 40, 2, 1000));  // past n_valid
  EXPECT_FALSE(dense.KeyVisible(page, 0, 3, 1000));   // another sequence
  EXPECT_TRUE(causal.PageNeedsMask(page, true, 120));  // keys 121…139 are after the first query
  page.n_valid = kPageTokens;
  EXPECT_FALSE(causal.PageNeedsMask(page, true, 163));
  EXPECT_TRUE(dense.PageNeedsMask(page, false, 0));  // a tile of two sequences
}

}  // namespace
}  // namespace kvpack
