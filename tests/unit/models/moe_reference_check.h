// The comparison of a MoE model against transformers through a reference script
// (tests/reference/qwen3_moe_reference.py, deepseek_v3_reference.py) that loads titan's weights into
// the transformers model: for a random batch of 2 x 32 tokens, logits, loss and every parameter's
// gradient within `tol` relative to each tensor's largest entry, and every MoE layer's routed copies
// per expert equal (routing is discrete). The folder `dir` holds hf/config.json and
// weights.safetensors (titan's names). Prints one summary line under `label`.
#pragma once

#include "test_util.h"

#include "titan/components/checkpoint/safetensors.h"
#include "titan/models/model.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace titan::test {

inline void expect_moe_model_equals_reference(LanguageModelImpl& model, const std::string& script,
                                              const std::string& dir, const std::string& label, double tol) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor seq = at::randint(300, {2, 33}, gen, at::kLong);
  const at::Tensor tokens = seq.slice(1, 0, 32).contiguous(), labels = seq.slice(1, 1, 33).contiguous();
  safetensors::save(dir + "/batch.safetensors", {{"tokens", tokens}, {"labels", labels}});
  auto r = run_process({python(), script, dir + "/hf", dir + "/weights.safetensors", dir + "/batch.safetensors",
                        dir + "/out.safetensors"},
                       {{"OMP_NUM_THREADS", "2"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = safetensors::load(dir + "/out.safetensors").tensors;

  const at::Tensor logits = model.forward(tokens);
  const at::Tensor loss = at::cross_entropy_loss(logits.flatten(0, 1), labels.flatten());
  loss.backward();
  EXPECT_LT(relative_error(logits.detach(), ref.at("logits")), tol);
  EXPECT_LT(relative_error(loss.detach(), ref.at("loss")), tol);
  double worst = 0;
  for (const auto& p : model.named_parameters()) {
    ASSERT_TRUE(ref.count("grad." + p.key())) << p.key();
    const double err = relative_error(p.value().grad(), ref.at("grad." + p.key()));
    EXPECT_LT(err, tol) << p.key();
    worst = std::max(worst, err);
  }
  // The same tokens went to the same experts: 64 tokens, as many copies as each chooses experts.
  for (const auto& [prefix, layer] : model.moe_layers()) {
    const std::string id = prefix.substr(7, prefix.find('.', 7) - 7);  // "layers.3.moe." -> "3"
    const at::Tensor counts = layer->tokens_per_expert;
    EXPECT_EQ(counts.sum().item<double>(), 64.0 * static_cast<double>(layer->options().top_k)) << prefix;
    EXPECT_TRUE(at::equal(counts, ref.at("counts." + id))) << prefix << counts;
  }
  std::printf("[%s vs transformers] loss %.6f, %zu gradients, worst relative error %.2e\n", label.c_str(),
              loss.item<double>(), model.named_parameters().size(), worst);
}

}  // namespace titan::test
