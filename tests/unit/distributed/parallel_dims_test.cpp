#include "titan/common/error.h"
#include "titan/distributed/parallel_dims.h"

#include <gtest/gtest.h>

namespace titan::dist {
namespace {

TEST(ParallelDims, ResolvesTheShardDegreeAndValidates) {
  ParallelDims d(2, -1, 1, 2, 1, 16);
  EXPECT_EQ(d.dp_shard(), 4);
  EXPECT_EQ(d.dp_size(), 8);
  EXPECT_TRUE(d.fsdp_enabled());
  EXPECT_FALSE(d.ddp_enabled());
  EXPECT_TRUE(ParallelDims(2, 1, 1, 1, 1, 2).ddp_enabled());
  EXPECT_FALSE(ParallelDims(1, -1, 1, 1, 1, 1).dp_enabled());
  EXPECT_THROW(ParallelDims(1, 3, 1, 1, 1, 4), UserError);   // 3 != 4
  EXPECT_THROW(ParallelDims(3, -1, 1, 1, 1, 4), UserError);  // 4 not divisible by 3
  EXPECT_THROW(ParallelDims(0, -1, 1, 1, 1, 4), UserError);
  EXPECT_THROW(ParallelDims(1, -2, 1, 1, 1, 4), UserError);
}

TEST(ParallelDims, RankOrderIsPpReplicateShardCpTp) {
  // pp 2, dp_replicate 2, dp_shard 2, cp 1, tp 2: rank = ((pp*2 + r)*2 + s)*2 + t.
  ParallelDims d(2, 2, 1, 2, 2, 16);
  EXPECT_EQ(d.group_ranks("tp", 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(d.group_ranks("dp_shard", 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(d.group_ranks("dp_replicate", 5), (std::vector<int>{1, 5}));
  EXPECT_EQ(d.group_ranks("pp", 5), (std::vector<int>{5, 13}));
  EXPECT_EQ(d.group_ranks("dp", 5), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(d.rank_in("dp", 5), 2);
  EXPECT_EQ(d.group_ranks("dp_shard_cp", 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(d.group_ranks("world", 5).size(), 16u);
  // Every rank is in exactly one group of each dimension, and the groups partition the world.
  for (const char* dim : {"pp", "dp_replicate", "dp_shard", "cp", "tp", "dp"}) {
    std::vector<int> seen(16, 0);
    for (int r = 0; r < 16; ++r)
      if (d.group_ranks(dim, r)[0] == r || d.rank_in(dim, r) == 0)
        for (int m : d.group_ranks(dim, r)) ++seen[m];
    for (int r = 0; r < 16; ++r) EXPECT_EQ(seen[r], 1) << dim << " rank " << r;
  }
}

}  // namespace
}  // namespace titan::dist
