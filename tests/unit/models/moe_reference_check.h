// The comparison of a MoE model against transformers through a reference script
// (tests/reference/qwen3_moe_reference.py, deepseek_v3_reference.py) that loads titan's weights into
// the transformers model: for a random batch of 2 x 32 tokens, logits, loss and every parameter's
// gradient within `tol` relative to each tensor's largest entry, and every MoE layer's routed copies
// per expert equal (routing is discrete). The folder `dir` holds hf/config.json and
// weights.safetensors (titan's names). Prints one summary line under `label`.
//
// With `aux_coeff` > 0 (the config's output_router_logits and router_aux_loss_coef) both sides add
// the auxiliary load-balancing loss, the mean over the MoE layers of each layer's: titan's layers get
// the weight the trainer gives them in one process (aux_coeff / MoE layers), and their terms' mean
// equals the reference's "aux_loss".
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
                                              const std::string& dir, const std::string& label, double tol,
                                              double aux_coeff = 0) {
  const auto layers = model.moe_layers();
  for (const auto& [prefix, layer] : layers) layer->aux_loss_weight = aux_coeff / static_cast<double>(layers.size());
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
  if (aux_coeff > 0) {
    ASSERT_TRUE(ref.count("aux_loss"));
    at::Tensor terms = at::zeros({});
    for (const auto& [prefix, layer] : layers) terms = terms + layer->aux_loss_terms;
    const at::Tensor aux = terms / static_cast<double>(layers.size());
    EXPECT_LT(relative_error(aux, ref.at("aux_loss")), tol);
    std::printf("[%s vs transformers] auxiliary loss %.6f (reference %.6f)\n", label.c_str(), aux.item<double>(),
                ref.at("aux_loss").item<double>());
  } else {
    EXPECT_FALSE(ref.count("aux_loss"));
  }
  std::printf("[%s vs transformers] loss %.6f, %zu gradients, worst relative error %.2e\n", label.c_str(),
              loss.item<double>(), model.named_parameters().size(), worst);
}

}  // namespace titan::test
