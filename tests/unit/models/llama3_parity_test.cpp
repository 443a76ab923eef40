// Numerical parity of titan's Llama 3 with an independent PyTorch implementation
// (tests/reference/llama3_reference.py).
//
// The C++ side initializes the model, writes its weights and token batches as safetensors, runs the
// Python reference on them, and compares:
//   - logits and loss of one batch, and the gradient of every parameter;
//   - the losses of 10 AdamW steps (lr 1e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1).
// Errors are max|titan - ref| / max|ref| per tensor ("relative to the tensor's scale": an
// element-wise relative error is meaningless for entries that are ~0).
//
// Tolerances, fp32 on CPU:
//   logits, loss: 1e-5. Both sides run fp32 ATen kernels; they differ only in operation order
//     (SDPA vs explicit softmax attention, RoPE scaling in Python floats vs fp32 tensors, fused vs
//     written-out RMSNorm), which leaves ~1e-7..1e-6 relative differences.
//   gradients: 1e-5, the same reasoning through the backward pass.
//   AdamW losses: 1e-5 relative to each loss. Adam divides by sqrt(v), which magnifies the rounding
//     differences of near-zero gradient entries; after 10 steps the losses still agree to ~1e-6.
// CUDA (when a GPU is present): fp32 as above but 1e-4 (TF32 is off, yet kernels and reduction
//   orders differ from the CPU's). bf16 autocast: no fixed tolerance. Both titan under bf16 and the
//   reference under bf16 are compared with the reference in fp32 on the same GPU, and titan's error
//   must stay within twice the reference's own error plus bf16's unit rounding (2^-8 = 3.9e-3) per
//   tensor (logits, loss, every gradient, every AdamW loss): titan may round differently from PyTorch,
//   but not lose more precision than bf16 autocast itself does.
//
// The test is also shown to fail when anything is off: perturbing any single weight element, any
// single gradient element, or the loss by a small amount makes the comparison fail (see
// PerturbationsAreDetected).
#include "test_util.h"

#include "titan/common/autocast.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/models/llama3/llama3.h"
#include "titan/models/llama3/model.h"
#include "llama3_reference_config.h"

#include <algorithm>
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <optional>

namespace titan {
namespace {

constexpr uint64_t kSeed = 1234;
constexpr int64_t kBatch = 2, kSeqLen = 64, kSteps = 10;
constexpr double kLr = 1e-3;

struct Case {
  std::string name;
  llama3::ModelArgs args;
};

std::vector<Case> cases() {
  llama3::ModelArgs debug = llama3::flavor("debugmodel");
  llama3::ModelArgs gqa = debug;
  gqa.n_kv_heads = 4;  // 16 query heads share 4 key/value heads
  llama3::ModelArgs tied = debug;
  tied.n_kv_heads = 8;
  tied.tie_embeddings = true;
  return {{"debugmodel", debug}, {"gqa", gqa}, {"tied", tied}};
}

struct Precision {
  std::string name;
  at::DeviceType device;
  bool bf16_autocast;
  double tol_out, tol_grad, tol_losses;  // unused under bf16 autocast: the bound comes from the reference
};

// bf16's unit rounding (8 bits of significand): the floor of the derived bf16 bound.
constexpr double kBf16Rounding = 1.0 / 256;

struct Batches {
  at::Tensor tokens, labels;  // (steps, B, S)
};

Batches make_batches(int64_t vocab) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(99);
  at::Tensor seq = at::randint(vocab, {kSteps, kBatch, kSeqLen + 1}, gen, at::kLong);
  return {seq.slice(2, 0, kSeqLen).contiguous(), seq.slice(2, 1, kSeqLen + 1).contiguous()};
}

at::Tensor loss_of(const at::Tensor& logits_BSV, const at::Tensor& labels_BS) {
  return at::cross_entropy_loss(logits_BSV.flatten(0, 1).to(at::kFloat), labels_BS.flatten(0, 1));
}

struct Reference {
  safetensors::Tensors t;
};

// Writes `params` (names as the reference expects them), the batches and the model's shape, runs
// tests/reference/llama3_reference.py with `flags`, and reads its outputs.
Reference run_reference_script(const llama3::ModelArgs& a, const StateDict& params, const Batches& b,
                               const std::vector<std::string>& flags, const test::TempDir& dir) {
  safetensors::Tensors in;
  for (const auto& [name, t] : params) in["param." + name] = t;
  in["batch.tokens"] = b.tokens;
  in["batch.labels"] = b.labels;
  nlohmann::json cfg = test::llama3_reference_config(a);
  cfg["lr"] = kLr;
  safetensors::save(dir / "in.safetensors", in, {{"config", cfg.dump()}});
  std::vector<std::string> cmd = {test::python(), std::string(TITAN_SOURCE_DIR) + "/tests/reference/llama3_reference.py",
                                  dir / "in.safetensors", dir / "out.safetensors"};
  cmd.insert(cmd.end(), flags.begin(), flags.end());
  const bool cuda = std::find(flags.begin(), flags.end(), "cuda") != flags.end();
  std::map<std::string, std::string> env = {{"OMP_NUM_THREADS", "2"}};
  auto r = test::run_process(cmd, cuda ? test::with_visible_gpus(env) : env);
  if (r.exit_code != 0) throw std::runtime_error("python reference failed:\n" + r.output);
  return {safetensors::load(dir / "out.safetensors").tensors};
}

// The model's initial weights through the reference: logits, loss, gradients, AdamW losses.
Reference run_reference(const Case& c, llama3::Transformer& model, const Batches& b, const Precision& prec,
                        const test::TempDir& dir) {
  StateDict params;
  for (const auto& p : model->named_parameters()) params[p.key()] = p.value();
  std::vector<std::string> flags = {"--device", prec.device == at::kCUDA ? "cuda" : "cpu"};
  if (prec.bf16_autocast) flags.push_back("--autocast-bf16");
  return run_reference_script(c.args, params, b, flags, dir);
}

struct StepOutputs {
  at::Tensor logits, loss;
  std::map<std::string, at::Tensor> grads;
};

StepOutputs forward_backward(llama3::Transformer& model, const Batches& b, const Precision& prec) {
  model->zero_grad();
  const at::Device dev(prec.device);
  StepOutputs out;
  {
    CudaBf16Autocast autocast(prec.bf16_autocast);
    out.logits = model->forward(b.tokens[0].to(dev));
    out.loss = loss_of(out.logits, b.labels[0].to(dev));
  }
  out.loss.backward();
  for (const auto& p : model->named_parameters()) out.grads[p.key()] = p.value().grad().detach().clone();
  return out;
}

// Names of the tensors that disagree with the reference beyond tolerance; `report` gets every error.
// With `exact` (the reference in fp32, for a bf16 run), a tensor's bound is twice the bf16
// reference's own error against it plus bf16's rounding, and errors are measured against `exact`.
std::vector<std::string> mismatches(const StepOutputs& o, const Reference& ref, const Precision& prec,
                                    std::string* report = nullptr, const Reference* exact = nullptr) {
  std::vector<std::string> bad;
  auto check = [&](const std::string& name, const at::Tensor& actual, double tol) {
    auto it = ref.t.find(name);
    if (it == ref.t.end()) {
      bad.push_back(name + " (missing from the reference)");
      return;
    }
    double err = test::relative_error(actual, it->second);
    if (exact) {
      auto e = exact->t.find(name);
      if (e == exact->t.end()) {
        bad.push_back(name + " (missing from the fp32 reference)");
        return;
      }
      const double ref_err = test::relative_error(it->second, e->second);
      err = test::relative_error(actual, e->second);
      tol = 2 * ref_err + kBf16Rounding;
      if (report) *report += name + " " + std::to_string(err) + " (bound " + std::to_string(tol) + ")\n";
    } else if (report) {
      *report += name + " " + std::to_string(err) + "\n";
    }
    if (!(err <= tol)) bad.push_back(name);
  };
  check("logits", o.logits, prec.tol_out);
  check("loss", o.loss, prec.tol_out);
  for (const auto& [name, g] : o.grads) check("grad." + name, g, prec.tol_grad);
  return bad;
}

std::vector<double> adamw_losses(llama3::Transformer& model, const Batches& b, const Precision& prec) {
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(kLr).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  const at::Device dev(prec.device);
  std::vector<double> losses;
  for (int64_t step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    at::Tensor loss;
    {
      CudaBf16Autocast autocast(prec.bf16_autocast);
      loss = loss_of(model->forward(b.tokens[step].to(dev)), b.labels[step].to(dev));
    }
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

llama3::Transformer build(const Case& c, const Precision& prec) {
  llama3::Transformer m(c.args, at::TensorOptions().dtype(at::kFloat).device(prec.device));
  m->init_weights(kSeed);
  return m;
}

class Llama3Parity : public ::testing::TestWithParam<std::tuple<Case, Precision>> {};

TEST_P(Llama3Parity, MatchesPyTorchReference) {
  const auto& [c, prec] = GetParam();
  if (prec.device == at::kCUDA && !torch::cuda::is_available())
    GTEST_SKIP() << "no CUDA device visible: the " << prec.name << " parity check runs only on a GPU machine";
  at::globalContext().setAllowTF32CuBLAS(false);
  test::TempDir dir;
  Batches batches = make_batches(c.args.vocab_size);
  llama3::Transformer model = build(c, prec);
  Reference ref = run_reference(c, model, batches, prec, dir);
  // Under bf16 the yardstick is the reference's own error against fp32 on the same device.
  std::optional<Reference> exact;
  test::TempDir exact_dir;
  if (prec.bf16_autocast) exact = run_reference(c, model, batches, Precision{"fp32", prec.device, false, 0, 0, 0}, exact_dir);

  std::string report;
  StepOutputs out = forward_backward(model, batches, prec);
  auto bad = mismatches(out, ref, prec, &report, exact ? &*exact : nullptr);
  EXPECT_TRUE(bad.empty()) << "tensors beyond tolerance: " << bad.size() << " (first: " << (bad.empty() ? "" : bad[0])
                           << ")\nrelative errors:\n" << report;
  double worst_grad = 0;
  for (const auto& [name, g] : out.grads) worst_grad = std::max(worst_grad, test::relative_error(g, ref.t.at("grad." + name)));
  std::printf("[%s/%s] loss %.6f; relative errors: logits %.2e, loss %.2e, worst gradient %.2e\n", c.name.c_str(),
              prec.name.c_str(), ref.t.at("loss").item<double>(), test::relative_error(out.logits, ref.t.at("logits")),
              test::relative_error(out.loss, ref.t.at("loss")), worst_grad);

  llama3::Transformer fresh = build(c, prec);
  std::vector<double> losses = adamw_losses(fresh, batches, prec);
  at::Tensor expected = ref.t.at("adamw_losses");
  ASSERT_EQ(expected.numel(), kSteps);
  for (int64_t i = 0; i < kSteps; ++i) {
    const double e = expected[i].item<double>();
    if (exact) {  // |titan - fp32| within twice |reference bf16 - fp32| plus bf16's rounding of the loss
      const double e32 = exact->t.at("adamw_losses")[i].item<double>();
      EXPECT_LE(std::abs(losses[i] - e32), 2 * std::abs(e - e32) + kBf16Rounding * std::abs(e32))
          << "AdamW step " << i + 1 << ": titan bf16 " << losses[i] << ", reference bf16 " << e << ", fp32 " << e32;
      continue;
    }
    EXPECT_LE(std::abs(losses[i] - e), prec.tol_losses * std::abs(e)) << "AdamW step " << i + 1 << ": titan "
                                                                      << losses[i] << " reference " << e;
  }
  EXPECT_LT(losses.back(), losses.front()) << "10 AdamW steps did not lower the loss";
  std::printf("[%s/%s] AdamW losses: first %.6f last %.6f (reference %.6f %.6f)\n", c.name.c_str(), prec.name.c_str(),
              losses.front(), losses.back(), expected[0].item<double>(), expected[kSteps - 1].item<double>());
}

const Precision kCpu{"cpu-fp32", at::kCPU, false, 1e-5, 1e-5, 1e-5};
const Precision kCudaFp32{"cuda-fp32", at::kCUDA, false, 1e-4, 1e-4, 1e-4};
const Precision kCudaBf16{"cuda-bf16-autocast", at::kCUDA, true, 0, 0, 0};

INSTANTIATE_TEST_SUITE_P(All, Llama3Parity,
                         ::testing::Combine(::testing::ValuesIn(cases()),
                                            ::testing::Values(kCpu, kCudaFp32, kCudaBf16)),
                         [](const auto& info) {
                           std::string n = std::get<0>(info.param).name + "_" + std::get<1>(info.param).name;
                           for (auto& ch : n) if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// The HF adapter: titan's weights converted to Hugging Face's names and rotate-half layout give, in a
// transformers-convention forward pass, the logits titan computes (1e-5; fp32 CPU).
TEST(Llama3Parity, HuggingFaceLayoutGivesTheSameLogits) {
  for (const Case& c : cases()) {
    test::TempDir dir;
    Batches batches = make_batches(c.args.vocab_size);
    llama3::Transformer model = build(c, kCpu);
    StateDict native;
    for (const auto& p : model->named_parameters()) native[p.key()] = p.value().detach();
    Reference ref = run_reference_script(c.args, llama3::hf_adapter(c.args).to_hf(native), batches, {"--hf"}, dir);
    at::Tensor logits;
    {
      at::NoGradGuard no_grad;
      logits = model->forward(batches.tokens[0]);
    }
    const double err = test::relative_error(logits, ref.t.at("logits"));
    EXPECT_LT(err, 1e-5) << c.name;
    std::printf("[%s] HF layout logits relative error %.2e\n", c.name.c_str(), err);
  }
}

// The comparison is sensitive: one perturbed weight element, gradient element or loss makes it fail.
TEST(Llama3Parity, PerturbationsAreDetected) {
  const Case c = cases()[0];
  test::TempDir dir;
  Batches batches = make_batches(c.args.vocab_size);
  llama3::Transformer model = build(c, kCpu);
  Reference ref = run_reference(c, model, batches, kCpu, dir);
  StepOutputs good = forward_backward(model, batches, kCpu);
  ASSERT_TRUE(mismatches(good, ref, kCpu).empty());

  // The loss, nudged by 1e-4 relative.
  StepOutputs o = good;
  o.loss = good.loss * (1 + 1e-4);
  EXPECT_FALSE(mismatches(o, ref, kCpu).empty()) << "perturbed loss went unnoticed";

  // Each gradient, one element (its largest) nudged by 1e-4 of the tensor's scale.
  for (const auto& [name, g] : good.grads) {
    StepOutputs p = good;
    p.grads[name] = g.clone();
    const int64_t i = g.abs().argmax().item<int64_t>();
    p.grads[name].view(-1)[i] += 1e-4 * g.abs().max().item<double>();
    auto bad = mismatches(p, ref, kCpu);
    EXPECT_EQ(bad, std::vector<std::string>{"grad." + name}) << "perturbed gradient " << name;
  }

  // Each weight, one element nudged by 1e-3 of the tensor's scale before the forward pass.
  for (const auto& param : model->named_parameters()) {
    at::Tensor w = param.value();
    // An interior element; for the embedding table, one in the row of a token the batch uses
    // (rows of unused tokens influence nothing the test observes).
    int64_t i = (w.numel() * 7) / 13;
    if (param.key() == "tok_embeddings.weight") i = batches.tokens[0][0][0].item<int64_t>() * w.size(1) + 5;
    const double delta = 1e-3 * w.abs().max().item<double>();
    {
      at::NoGradGuard no_grad;
      w.view(-1)[i] += delta;
    }
    EXPECT_FALSE(mismatches(forward_backward(model, batches, kCpu), ref, kCpu).empty())
        << "perturbed weight " << param.key() << " went unnoticed";
    {
      at::NoGradGuard no_grad;
      w.view(-1)[i] -= delta;
    }
  }
}

}  // namespace
}  // namespace titan
