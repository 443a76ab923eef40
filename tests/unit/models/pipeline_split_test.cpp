#include "titan/common/error.h"
#include "titan/models/pipeline_split.h"
#include "titan/models/registry.h"

#include <gtest/gtest.h>

namespace titan {
namespace {

TEST(PipelineSplit, SpreadsEffectiveLayersEvenly) {
  using Stages = std::vector<std::vector<std::string>>;
  // 6 blocks + 1 + 1 = 8 effective layers over 2 stages: 4 each.
  EXPECT_EQ(pipeline_split(2, 6), (Stages{{"tok_embeddings", "layers.0", "layers.1", "layers.2"},
                                         {"layers.3", "layers.4", "layers.5", "norm", "output"}}));
  // 6 + 2 = 8 over 3 stages: 3, 3, 2 (the first stages take the remainder).
  EXPECT_EQ(pipeline_split(3, 6), (Stages{{"tok_embeddings", "layers.0", "layers.1"},
                                         {"layers.2", "layers.3", "layers.4"},
                                         {"layers.5", "norm", "output"}}));
  EXPECT_EQ(pipeline_split(1, 2), (Stages{{"tok_embeddings", "layers.0", "layers.1", "norm", "output"}}));
  // Llama 3 405B: 126 blocks over 8 stages, every block placed once.
  auto stages = model_spec("llama3").pipeline_split("405B", 8, 1, 1);
  ASSERT_EQ(stages.size(), 8u);
  size_t blocks = 0;
  for (const auto& s : stages)
    for (const auto& m : s) blocks += m.rfind("layers.", 0) == 0;
  EXPECT_EQ(blocks, 126u);
  EXPECT_EQ(stages[0].front(), "tok_embeddings");
  EXPECT_EQ(stages[7].back(), "output");
}

TEST(PipelineSplit, ImpossibleSplitsAreClearErrors) {
  EXPECT_THROW(pipeline_split(9, 6), UserError);        // 9 stages, 8 effective layers
  EXPECT_THROW(pipeline_split(4, 2, 3, 1), UserError);  // embedding weight 3 > 1 layer per stage
  EXPECT_THROW(pipeline_split(0, 6), UserError);
}

}  // namespace
}  // namespace titan
