#include "titan/common/tensor_storage.h"
#include "titan/models/llama3/model.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace titan {
namespace {

TEST(DeferAllocation, ModelsBuildWithoutMemoryAndInitializePieceByPiece) {
  llama3::ModelArgs args = llama3::flavor("debugmodel");
  args.n_layers = 2;
  llama3::Transformer eager(args, at::TensorOptions()), deferred(nullptr);
  eager->init_weights(4);
  {
    DeferAllocation defer;
    deferred = llama3::Transformer(args, at::TensorOptions());
  }
  EXPECT_FALSE(DeferAllocation::active());
  for (const auto& p : deferred->named_parameters()) {
    EXPECT_FALSE(has_storage(p.value())) << p.key();
    EXPECT_EQ(p.value().storage().nbytes(), 0u) << p.key();
  }
  // Give one block memory: init fills exactly it, with the values the eager model has.
  auto* block = deferred->blocks()[1].second;
  for (const auto& p : block->parameters()) allocate_storage(p);
  deferred->init_weights(4);
  auto ref = eager->named_parameters();
  for (const auto& p : deferred->named_parameters()) {
    const bool in_block = p.key().rfind("layers.1.", 0) == 0;
    EXPECT_EQ(has_storage(p.value()), in_block) << p.key();
    if (in_block) EXPECT_TRUE(at::equal(p.value(), ref[p.key()])) << p.key();
  }
}

}  // namespace
}  // namespace titan
