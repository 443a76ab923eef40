// Llama 3 shapes, parameter counts, FLOPs, initialization and the Hugging Face adapter.
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/models/llama3/llama3.h"
#include "titan/models/llama3/model.h"
#include "titan/models/registry.h"
#include "titan/tools/estimate.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

namespace titan {
namespace {

const at::TensorOptions kMeta = at::TensorOptions().device(at::kMeta).dtype(at::kFloat);

TEST(Llama3Flavors, FeedForwardHiddenSizesAreTorchtitans) {
  const std::map<std::string, int64_t> hidden = {{"debugmodel", 768}, {"1B", 8192},  {"3B", 8192},
                                                 {"8B", 14336},       {"70B", 28672}, {"405B", 53248}};
  for (const auto& [name, h] : hidden) EXPECT_EQ(llama3::flavor(name).ffn_hidden_dim(), h) << name;
}

TEST(Llama3Flavors, ParameterCounts) {
  // 8B: the published count. The others follow from the shapes; computed here by formula
  // independently of the module tree (which the estimate counts from meta tensors).
  EXPECT_EQ(estimate_model("llama3", "8B", 8192).params, 8030261248);
  for (const auto& [name, a] : llama3::flavors()) {
    const int64_t D = a.dim, E = a.head_dim(), F = a.ffn_hidden_dim();
    const int64_t layer = D * a.n_heads * E * 2 + D * a.kv_heads() * E * 2 + 3 * D * F + 2 * D;
    const int64_t expected = a.vocab_size * D * (a.tie_embeddings ? 1 : 2) + a.n_layers * layer + D;
    EXPECT_EQ(estimate_model("llama3", name, 2048).params, expected) << name;
  }
}

TEST(Llama3Flavors, EstimateOf405BNeedsNoMemoryAndFlopsFollowTheFormula) {
  auto e = estimate_model("llama3", "405B", 8192);
  EXPECT_GT(e.params, 405'000'000'000);
  EXPECT_LT(e.params, 406'000'000'000);
  const double emb = 128256.0 * 16384;
  EXPECT_DOUBLE_EQ(e.flops_per_token, 6.0 * (e.params - emb) + 12.0 * 126 * 128 * 128 * 8192);
  EXPECT_EQ(e.param_bytes, 4 * e.params);
  EXPECT_EQ(e.optimizer_bytes, 8 * e.params);
  // 8B at seq_len 8192: 6 * (8,030,261,248 - 525,336,576) + 12 * 32 * 32 * 128 * 8192
  EXPECT_DOUBLE_EQ(estimate_model("llama3", "8B", 8192).flops_per_token, 6.0 * 7504924672.0 + 12.0 * 32 * 32 * 128 * 8192);
}

TEST(Llama3Flavors, UnknownNamesListTheChoices) {
  try {
    estimate_model("llama3", "7B", 2048);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("debugmodel, 1B, 3B, 8B, 70B, 405B"), std::string::npos) << e.what();
  }
  EXPECT_THROW(model_spec("gpt5"), UserError);
}

TEST(Llama3Model, ParameterNamesAreTorchtitans) {
  llama3::ModelArgs args = llama3::flavor("debugmodel");
  args.n_layers = 1;
  llama3::Transformer m(args, kMeta);
  std::vector<std::string> names;
  for (const auto& p : m->named_parameters()) names.push_back(p.key());
  const std::vector<std::string> expected = {
      "tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
      "layers.0.attention.wv.weight", "layers.0.attention.wo.weight", "layers.0.feed_forward.w1.weight",
      "layers.0.feed_forward.w2.weight", "layers.0.feed_forward.w3.weight", "layers.0.attention_norm.weight",
      "layers.0.ffn_norm.weight", "norm.weight", "output.weight"};
  EXPECT_EQ(names, expected);
  args.tie_embeddings = true;
  llama3::Transformer tied(args, kMeta);
  EXPECT_FALSE(tied->named_parameters().contains("output.weight"));
}

TEST(Llama3Init, FollowsTorchtitansDistributions) {
  llama3::ModelArgs args = llama3::flavor("debugmodel");
  llama3::Transformer m(args, at::TensorOptions().dtype(at::kFloat));
  m->init_weights(7);
  auto p = m->named_parameters();
  auto stats = [&](const std::string& n) {
    at::Tensor t = p[n].to(at::kDouble);
    return std::make_tuple(t.mean().item<double>(), t.std().item<double>(), t.abs().max().item<double>());
  };
  // Token embeddings: N(0, 1).
  auto [em, es, ex] = stats("tok_embeddings.weight");
  EXPECT_NEAR(em, 0.0, 0.01);
  EXPECT_NEAR(es, 1.0, 0.01);
  // Input projections: truncated normal, std 0.02 (the absolute +-2 cut-off never binds).
  auto [qm, qs, qx] = stats("layers.3.attention.wq.weight");
  EXPECT_NEAR(qs, 0.02, 0.0005);
  // Output projections: std 0.02 / sqrt(2 (layer + 1)).
  for (int layer : {0, 5}) {
    const double expected = 0.02 / std::sqrt(2.0 * (layer + 1));
    for (const char* w : {"attention.wo", "feed_forward.w2", "feed_forward.w3"}) {
      auto [m_, s_, x_] = stats("layers." + std::to_string(layer) + "." + w + ".weight");
      EXPECT_NEAR(s_, expected, expected * 0.03) << layer << " " << w;
    }
  }
  // Output layer: std dim^-0.5 truncated at 3 std (so its std is ~0.986 of that).
  const double out_std = 1.0 / 16.0;
  auto [om, os, ox] = stats("output.weight");
  EXPECT_LE(ox, 3 * out_std + 1e-7);
  EXPECT_GT(ox, 2.9 * out_std);
  EXPECT_NEAR(os, 0.9866 * out_std, 0.01 * out_std);
  EXPECT_TRUE(at::equal(p["norm.weight"], at::ones({256})));
}

TEST(Llama3Init, IsAFunctionOfSeedAndNameOnly) {
  llama3::ModelArgs small = llama3::flavor("debugmodel");
  small.n_layers = 2;
  llama3::ModelArgs deep = small;
  deep.n_layers = 3;
  llama3::Transformer a(small, at::TensorOptions()), b(deep, at::TensorOptions()), c(small, at::TensorOptions());
  a->init_weights(1);
  b->init_weights(1);
  c->init_weights(2);
  // Same name, same seed -> same values, whatever else the model holds (here: another layer).
  for (const auto& p : a->named_parameters()) {
    if (p.key() == "layers.1.attention.wo.weight" || p.key().find("norm") != std::string::npos) continue;
    EXPECT_TRUE(at::equal(p.value(), b->named_parameters()[p.key()])) << p.key();
    EXPECT_FALSE(at::equal(p.value(), c->named_parameters()[p.key()])) << p.key();
  }
  // Different names draw different values.
  EXPECT_FALSE(at::equal(a->named_parameters()["layers.0.attention.wq.weight"],
                         a->named_parameters()["layers.1.attention.wq.weight"]));
}

TEST(Llama3HFAdapter, RoundTripAndRotateHalfPermutation) {
  llama3::ModelArgs args = llama3::flavor("debugmodel");
  args.n_layers = 2;
  args.n_kv_heads = 4;
  llama3::Transformer m(args, at::TensorOptions());
  m->init_weights(3);
  StateDict sd;
  for (const auto& p : m->named_parameters()) sd[p.key()] = p.value().detach();
  ASSERT_TRUE(model_spec("llama3").hf_adapter);
  auto hf = llama3::hf_adapter(args).to_hf(sd);
  EXPECT_EQ(hf.size(), sd.size());
  ASSERT_TRUE(hf.count("model.layers.1.self_attn.k_proj.weight"));
  ASSERT_TRUE(hf.count("lm_head.weight"));
  // HF's rotate-half layout puts pair member 0 of every rotation pair in the first half of each head.
  const int64_t E = args.head_dim();
  at::Tensor wq = sd["layers.0.attention.wq.weight"], hq = hf["model.layers.0.self_attn.q_proj.weight"];
  EXPECT_TRUE(at::equal(hq.slice(0, 0, E / 2), wq.slice(0, 0, E, 2)));
  EXPECT_TRUE(at::equal(hq.slice(0, E / 2, E), wq.slice(0, 1, E, 2)));
  auto back = llama3::hf_adapter(args).from_hf(hf);
  ASSERT_EQ(back.size(), sd.size());
  for (const auto& [name, t] : sd) EXPECT_TRUE(at::equal(back.at(name), t)) << name;
  hf["model.layers.0.mystery.weight"] = at::ones({1});
  EXPECT_THROW(llama3::hf_adapter(args).from_hf(hf), UserError);
}

}  // namespace
}  // namespace titan
