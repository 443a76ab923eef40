// The MoE layer (nn/moe.h) against an independent PyTorch reference written from the routing
// formulas token by token (tests/reference/moe_reference.py): the chosen experts exactly, and the
// output, the routing weights and every gradient (input, gate, experts, shared experts) within 1e-5
// relative to each tensor's largest entry (fp32 on the CPU; the two sides differ only in summation
// order: grouped matmuls over sorted tokens against per-token products). The auxiliary
// load-balancing loss (softmax and sigmoid scores) adds its gradient with its weight, and its value
// is the reference's.
#include "test_util.h"

#include "titan/components/checkpoint/safetensors.h"
#include "titan/nn/activation_checkpoint.h"
#include "titan/nn/moe.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

namespace titan {
namespace {

constexpr double kTol = 1e-5;

struct Case {
  std::string name;
  nn::MoEOptions options;
  int64_t tokens;
  double aux_weight = 0;  // the auxiliary loss's weight in the loss (0: none)
  bool force_load_balance = false;  // torchtitan's debug round-robin routing
};

std::vector<Case> cases() {
  nn::MoEOptions softmax;  // Qwen3-MoE's routing: softmax, normalized top-k, no shared expert
  softmax.dim = 16;
  softmax.hidden_dim = 12;
  softmax.num_experts = 8;
  softmax.top_k = 2;
  softmax.route_norm = true;
  nn::MoEOptions deepseek;  // DeepSeek-V3's: sigmoid, group-limited, scaled, a shared expert
  deepseek.dim = 16;
  deepseek.hidden_dim = 8;
  deepseek.num_experts = 8;
  deepseek.top_k = 3;
  deepseek.score_func = "sigmoid";
  deepseek.route_norm = true;
  deepseek.route_scale = 2.5;
  deepseek.n_groups = 4;
  deepseek.topk_groups = 2;
  deepseek.num_shared_experts = 1;
  nn::MoEOptions unaligned = softmax;  // rows of 6 floats: the per-expert matmul path
  unaligned.hidden_dim = 6;
  unaligned.top_k = 3;
  unaligned.route_norm = false;
  return {{"softmax_top2", softmax, 40},
          {"sigmoid_grouped_shared", deepseek, 40},
          {"unaligned_loop", unaligned, 24},
          {"softmax_top2_aux_loss", softmax, 40, 3.0},
          {"sigmoid_grouped_shared_aux_loss", deepseek, 40, 3.0},
          {"softmax_top2_forced_balance", softmax, 40, 0, true},
          {"sigmoid_grouped_shared_forced_balance", deepseek, 40, 0, true}};
}

TEST(MoELayer, EqualsTheReferenceWrittenFromTheFormulas) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    test::TempDir dir;
    nn::MoE moe(c.options, at::TensorOptions().dtype(at::kFloat));
    moe->aux_loss_weight = c.aux_weight;
    moe->force_load_balance = c.force_load_balance;
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(17);
    {
      at::NoGradGuard no_grad;
      for (auto& p : moe->named_parameters()) p.value().copy_(at::randn(p.value().sizes(), gen) * 0.3);
      if (moe->expert_bias.defined()) moe->expert_bias.copy_(at::randn({c.options.num_experts}, gen) * 0.05);
    }
    const at::Tensor x = (at::randn({c.tokens, c.options.dim}, gen)).requires_grad_(true);
    const at::Tensor grad_out = at::randn({c.tokens, c.options.dim}, gen);

    safetensors::Tensors in = {{"x", x.detach()},
                               {"gate", moe->router->gate->weight.detach()},
                               {"w1", moe->experts->w1.detach()},
                               {"w2", moe->experts->w2.detach()},
                               {"w3", moe->experts->w3.detach()},
                               {"grad_out", grad_out}};
    if (moe->shared_experts) {
      in["shared_w1"] = moe->shared_experts->w1->weight.detach();
      in["shared_w2"] = moe->shared_experts->w2->weight.detach();
      in["shared_w3"] = moe->shared_experts->w3->weight.detach();
    }
    if (moe->expert_bias.defined()) in["expert_bias"] = moe->expert_bias;
    const nlohmann::json options = {{"top_k", c.options.top_k},         {"score_func", c.options.score_func},
                                    {"route_norm", c.options.route_norm}, {"route_scale", c.options.route_scale},
                                    {"n_groups", c.options.n_groups},     {"topk_groups", c.options.topk_groups},
                                    {"aux_weight", c.aux_weight},         {"force_load_balance", c.force_load_balance}};
    safetensors::save(dir / "in.safetensors", in, {{"options", options.dump()}});
    auto r = test::run_process({test::python(), std::string(TITAN_SOURCE_DIR) + "/tests/reference/moe_reference.py",
                                dir / "in.safetensors", dir / "out.safetensors"},
                               {{"OMP_NUM_THREADS", "2"}});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto ref = safetensors::load(dir / "out.safetensors").tensors;

    const nn::Routing routing = nn::route(moe->router(x.detach()), moe->expert_bias, c.options, c.force_load_balance);
    EXPECT_TRUE(at::equal(routing.ids_TK, ref.at("ids"))) << "the chosen experts differ";
    if (c.force_load_balance)  // 40 tokens x K copies over 8 experts: exactly balanced
      EXPECT_TRUE(at::equal(routing.counts_E, at::full({c.options.num_experts}, c.tokens * c.options.top_k / 8, at::kLong)));
    EXPECT_TRUE(at::equal(routing.counts_E, ref.at("counts")));
    EXPECT_LT(test::relative_error(routing.weights_TK.detach(), ref.at("weights")), kTol);

    const at::Tensor y = moe->forward(x.unsqueeze(0)).squeeze(0);
    (y * grad_out).sum().backward();
    EXPECT_LT(test::relative_error(y.detach(), ref.at("y")), kTol);
    EXPECT_LT(test::relative_error(x.grad(), ref.at("grad.x")), kTol);
    EXPECT_LT(test::relative_error(moe->router->gate->weight.grad(), ref.at("grad.gate")), kTol);
    for (const char* w : {"w1", "w2", "w3"}) {
      const at::Tensor& mine = std::string(w) == "w1" ? moe->experts->w1 : std::string(w) == "w2" ? moe->experts->w2 : moe->experts->w3;
      EXPECT_LT(test::relative_error(mine.grad(), ref.at(std::string("grad.") + w)), kTol) << w;
    }
    if (moe->shared_experts) {
      EXPECT_LT(test::relative_error(moe->shared_experts->w1->weight.grad(), ref.at("grad.shared_w1")), kTol);
      EXPECT_LT(test::relative_error(moe->shared_experts->w2->weight.grad(), ref.at("grad.shared_w2")), kTol);
    }
    // One forward counted its routed copies once.
    EXPECT_TRUE(at::equal(moe->tokens_per_expert, ref.at("counts").to(at::kFloat)));
    if (c.aux_weight > 0) {
      ASSERT_TRUE(moe->aux_loss_terms.defined());
      EXPECT_LT(test::relative_error(moe->aux_loss_terms, ref.at("aux")), kTol);
      EXPECT_GT(ref.at("aux").item<double>(), 1.0);  // K when balanced, more when not
    } else {
      EXPECT_FALSE(moe->aux_loss_terms.defined());
    }
  }
}

TEST(MoELayer, GroupedMatmulEqualsOneMatmulPerExpert) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor w = at::randn({4, 12, 8}, gen);
  for (const std::vector<int64_t>& counts : {std::vector<int64_t>{3, 0, 5, 2}, std::vector<int64_t>{0, 0, 10, 0}}) {
    const at::Tensor c = at::tensor(counts, at::kLong);
    const at::Tensor x = at::randn({10, 8}, gen);
    std::vector<at::Tensor> parts;
    int64_t begin = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
      parts.push_back(at::matmul(x.narrow(0, begin, counts[e]), w[e].t()));
      begin += counts[e];
    }
    EXPECT_LT(test::relative_error(nn::grouped_linear(x, w, c), at::cat(parts)), 1e-6);
    EXPECT_TRUE(at::equal(nn::grouped_linear(x, w, c, /*grouped=*/false), at::cat(parts)));
  }
}

// On a GPU: at::_grouped_mm's kernels (forward, and the transposed products of the backward, where
// the weight gradient sums over each expert's jagged group of rows) in bf16 against float64 products
// of the same bf16 values, one expert at a time: within 5e-3 of each tensor's largest entry (the bf16
// result's rounding, half a unit: up to 2^-8 = 3.9e-3 of an entry), and exactly zero for an expert
// without tokens. Group sizes that are not multiples of 16, and an empty group.
TEST(CudaMoE, GroupedMatmulsOnTheGpuEqualFloat64PerExpert) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible: this check runs only on a GPU machine";
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const std::vector<int64_t> counts = {5, 0, 17, 42};
  const at::Tensor w0 = at::randn({4, 48, 32}, gen).to(at::kBFloat16), x0 = at::randn({64, 32}, gen).to(at::kBFloat16);
  const at::Tensor gy = at::randn({64, 48}, gen).to(at::kBFloat16);
  const at::Tensor x = x0.cuda().requires_grad_(true), w = w0.cuda().requires_grad_(true);
  const at::Tensor y = nn::grouped_linear(x, w, at::tensor(counts, at::kLong).cuda());
  y.backward(gy.cuda());
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  std::vector<at::Tensor> ys, gxs, gws;
  int64_t begin = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const at::Tensor xe = x0.narrow(0, begin, counts[e]).to(at::kDouble), we = w0[e].to(at::kDouble);
    const at::Tensor ge = gy.narrow(0, begin, counts[e]).to(at::kDouble);
    ys.push_back(at::matmul(xe, we.t()));
    gxs.push_back(at::matmul(ge, we));
    gws.push_back(at::matmul(ge.t(), xe).unsqueeze(0));
    begin += counts[e];
  }
  EXPECT_LT(test::relative_error(y, at::cat(ys)), 5e-3);
  EXPECT_LT(test::relative_error(x.grad(), at::cat(gxs)), 5e-3);
  EXPECT_LT(test::relative_error(w.grad(), at::cat(gws)), 5e-3);
  EXPECT_TRUE(at::equal(w.grad()[1].cpu(), at::zeros({48, 32}, at::kBFloat16))) << "an expert without tokens";
}

// The copies' dispatch and combine (nn::dispatch_rows, nn::combine_rows) against the scatter
// formulation torchtitan writes (routed = x[token], y = zeros.scatter_add(token, out * w), both through
// autograd): in float64 on the CPU within 1e-12 of each tensor's largest entry, every gradient too;
// in bf16 each product is rounded as torchtitan's is, the K of a token summed in fp32: within two bf16
// roundings (the product's and the sum's, 2^-8 each at most) of the float64 result. (The meta
// device's path, what the kernels allocate, runs in titan estimate's MoE tests.)
struct RowsCase {
  at::Tensor x, out, w, perm, gy;  // x (T, D), out (N, D), w (T, K), perm (N), gy (T, D)
};
RowsCase rows_case(int64_t T, int64_t K, int64_t D, at::ScalarType dtype, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t N = T * K;
  const at::ScalarType wtype = dtype == at::kDouble ? at::kDouble : at::kFloat;  // the router's fp32 (fp64 rows: fp64)
  return {at::randn({T, D}, gen).to(dtype), at::randn({N, D}, gen).to(dtype), at::rand({T, K}, gen).to(wtype),
          at::randperm(N, gen, at::kLong), at::randn({T, D}, gen).to(dtype)};
}

// (y, grad x, grad out, grad w) of dispatch-then-combine by the scatter formulation, in float64.
std::vector<at::Tensor> scatter_reference(const RowsCase& c) {
  const int64_t K = c.w.size(1);
  const auto leaf = [](const at::Tensor& t) { return t.detach().to(at::kDouble).clone().requires_grad_(true); };
  const at::Tensor x = leaf(c.x), out = leaf(c.out), w = leaf(c.w);
  const at::Tensor token = c.perm.div(K, "floor");
  const at::Tensor routed = x.index_select(0, token);
  const at::Tensor weighted = out * w.reshape({-1}).index_select(0, c.perm).unsqueeze(1);
  const at::Tensor y = at::zeros_like(x).scatter_add(0, token.unsqueeze(1).expand({-1, x.size(1)}), weighted);
  ((y * c.gy.to(at::kDouble)).sum() + (routed * out).sum()).backward();
  return {y.detach(), x.grad(), out.grad(), w.grad()};
}

// The same through nn::dispatch_rows and nn::combine_rows on `device`, results on the CPU. With
// `misaligned`, out's data starts one element past an allocation (16-byte rows, unaligned pointer).
std::vector<at::Tensor> titan_rows(const RowsCase& c, const at::Device& device, bool misaligned = false) {
  // Fresh leaves (on the CPU, .to would return the case's own tensors).
  const auto leaf = [&](const at::Tensor& t) { return t.detach().to(device).clone().requires_grad_(true); };
  const at::Tensor x = leaf(c.x), w = leaf(c.w);
  const nn::CopyOrder order = nn::copy_order(c.perm.to(device));
  at::Tensor out = leaf(c.out);
  if (misaligned) {
    const at::Tensor buffer = at::empty({c.out.numel() + 1}, c.out.options().device(device));
    out = buffer.narrow(0, 1, c.out.numel()).view(c.out.sizes());
    out.copy_(c.out);
    out.requires_grad_(true);
  }
  const at::Tensor routed = nn::dispatch_rows(x, order, c.w.size(1));
  const at::Tensor y = nn::combine_rows(out, w, order);
  ((y.to(at::kFloat) * c.gy.to(device).to(at::kFloat)).sum() + (routed.to(at::kFloat) * out.to(at::kFloat)).sum())
      .backward();
  return {y.detach().cpu(), x.grad().cpu(), out.grad().cpu(), w.grad().cpu()};
}

TEST(MoELayer, DispatchAndCombineEqualTheScatterFormulation) {
  const char* names[] = {"y", "grad x", "grad out", "grad w"};
  for (const int64_t K : {1, 3, 8}) {
    SCOPED_TRACE("K " + std::to_string(K));
    const auto empty = titan_rows(rows_case(0, K, 24, at::kFloat, 1), at::kCPU);  // no tokens
    EXPECT_EQ(empty[0].sizes(), (std::vector<int64_t>{0, 24}));
    EXPECT_EQ(empty[2].sizes(), (std::vector<int64_t>{0, 24}));
    const RowsCase c = rows_case(11, K, 24, at::kDouble, 7 + K);
    const auto ref = scatter_reference(c);
    const auto mine = titan_rows(c, at::kCPU);
    for (int i = 0; i < 4; ++i) EXPECT_LT(test::relative_error(mine[i], ref[i]), 1e-12) << names[i];
    const RowsCase b = rows_case(11, K, 24, at::kBFloat16, 7 + K);
    const auto ref_b = scatter_reference(b);
    const auto mine_b = titan_rows(b, at::kCPU);
    EXPECT_EQ(mine_b[0].scalar_type(), at::kBFloat16);
    EXPECT_EQ(mine_b[3].scalar_type(), at::kFloat);
    for (int i = 0; i < 4; ++i) EXPECT_LT(test::relative_error(mine_b[i], ref_b[i]), 2.0 / 256) << names[i];
  }
}

// On a GPU: the fused combine kernels (forward, backward, and the dispatch's backward through the
// forward kernel) against the CPU's ATen formulation of the same arithmetic, fp32, bf16 and fp16, rows
// of 16-byte packs and not (D 13), K 1, 3 and 8, more tokens than blocks loop over: within 2^-20 of
// each tensor's largest entry for fp32 and one rounding of the dtype otherwise (the products are
// rounded alike; the fp32 sums may differ in order), the rows' gradients bit for bit, and two runs
// bit for bit (no atomics); an unaligned out (the kernels' element path even for 16-byte rows), and
// no tokens. Then a whole MoE layer in bf16 on the GPU against fp32 on the CPU.
TEST(CudaMoE, CombineKernelsEqualTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible: this check runs only on a GPU machine";
  const char* names[] = {"y", "grad x", "grad out", "grad w"};
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const int64_t D : {2048, 24, 13}) {
      for (const int64_t K : {1, 3, 8}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " D " + std::to_string(D) + " K " + std::to_string(K));
        // 70000 tokens: more than the 65536 blocks of a launch, so blocks loop over tokens.
        const RowsCase c = rows_case(D == 2048 ? 70 : 70000, K, D, dtype, 100 + D + K);
        const auto cpu = titan_rows(c, at::kCPU);
        const auto gpu = titan_rows(c, at::kCUDA);
        const auto again = titan_rows(c, at::kCUDA);
        const auto unaligned = titan_rows(c, at::kCUDA, /*misaligned=*/true);
        const double tol = dtype == at::kFloat ? 1.0 / (1 << 20) : dtype == at::kHalf ? 1.0 / 1024 : 1.0 / 256;
        for (int i = 0; i < 4; ++i) {
          EXPECT_EQ(gpu[i].scalar_type(), cpu[i].scalar_type()) << names[i];
          EXPECT_LT(test::relative_error(gpu[i], cpu[i]), i == 3 ? 1e-5 : tol) << names[i];
          EXPECT_TRUE(at::equal(gpu[i], again[i])) << names[i] << ": two runs differ";
          EXPECT_LT(test::relative_error(unaligned[i], cpu[i]), i == 3 ? 1e-5 : tol) << names[i] << ", unaligned";
        }
        EXPECT_TRUE(at::equal(gpu[2], cpu[2])) << "the rows' gradients round(gy * w)";
        const auto empty = titan_rows(rows_case(0, K, D, dtype, 1), at::kCUDA);
        EXPECT_EQ(empty[0].sizes(), (std::vector<int64_t>{0, D}));
      }
    }
  }
  nn::MoEOptions o = cases()[0].options;
  o.dim = 64;
  o.hidden_dim = 32;
  nn::MoE cpu_layer(o, at::TensorOptions().dtype(at::kFloat));
  nn::MoE gpu_layer(o, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(21);
  {
    at::NoGradGuard no_grad;
    auto cp = cpu_layer->named_parameters(), gp = gpu_layer->named_parameters();
    for (auto& p : cp) p.value().copy_((at::randn(p.value().sizes(), gen) * 0.3).to(at::kBFloat16).to(at::kFloat));
    // A gate that chooses clearly (logits of the chosen two ~4 and ~2.4 apart from the rest's ~0), so
    // bf16 and fp32 route every token alike.
    cpu_layer->router->gate->weight.copy_(at::eye(o.num_experts, o.dim) * 4);
    for (auto& p : cp) gp[p.key()].copy_(p.value());
  }
  at::Tensor x0 = at::randn({1, 300, o.dim}, gen) * 0.1;
  for (int64_t t = 0; t < 300; ++t) {
    const int64_t a = t % o.num_experts, b = (a + 1 + t / o.num_experts % (o.num_experts - 1)) % o.num_experts;
    x0[0][t][a] += 1.0;
    x0[0][t][b] += 0.6;
  }
  x0 = x0.to(at::kBFloat16);
  const at::Tensor g0 = at::randn({1, 300, o.dim}, gen);
  const at::Tensor xc = x0.to(at::kFloat).requires_grad_(true), xg = x0.cuda().requires_grad_(true);
  const at::Tensor yc = cpu_layer->forward(xc), yg = gpu_layer->forward(xg);
  (yc * g0).sum().backward();
  (yg.to(at::kFloat) * g0.cuda()).sum().backward();
  // bf16 through the grouped matmuls and SwiGLU: a few roundings of 2^-9 each, against fp32.
  EXPECT_LT(test::relative_error(yg.cpu().to(at::kFloat), yc.detach()), 2e-2);
  EXPECT_LT(test::relative_error(xg.grad().cpu().to(at::kFloat), xc.grad()), 2e-2);
  EXPECT_LT(test::relative_error(gpu_layer->experts->w2.grad().cpu().to(at::kFloat), cpu_layer->experts->w2.grad()), 2e-2);
  EXPECT_LT(test::relative_error(gpu_layer->router->gate->weight.grad().cpu().to(at::kFloat),
                                 cpu_layer->router->gate->weight.grad()),
            5e-2);
}

TEST(MoELayer, ExpertBiasUpdateFollowsTheRule) {
  // counts 5, 1, 3, 3: mean 3; under-loaded experts rise by the rate, over-loaded ones fall, then the
  // moves are centred (here already zero-mean).
  at::Tensor bias = at::zeros({4});
  nn::update_expert_bias(bias, at::tensor({5.0, 1.0, 3.0, 3.0}), 1e-3);
  EXPECT_TRUE(at::allclose(bias, at::tensor({-1e-3, 1e-3, 0.0, 0.0}).to(at::kFloat), 0, 1e-9)) << bias;
  // counts 4, 0, 0, 0: mean 1; moves -1, +1, +1, +1 (x rate), centred by their mean 0.5.
  bias.zero_();
  nn::update_expert_bias(bias, at::tensor({4.0, 0.0, 0.0, 0.0}), 1e-3);
  EXPECT_TRUE(at::allclose(bias, at::tensor({-1.5e-3, 0.5e-3, 0.5e-3, 0.5e-3}).to(at::kFloat), 0, 1e-9)) << bias;
}

TEST(MoELayer, ActivationCheckpointingCountsTokensOnceAndKeepsTheAuxiliaryLossGradient) {
  // With the auxiliary loss on: the recomputed body adds the loss's gradient in backward (the first
  // forward ran without a graph), so the gradients equal those without checkpointing; the tokens and
  // the loss's terms are counted once.
  nn::MoEOptions o = cases()[0].options;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor x0 = at::randn({1, 20, o.dim}, gen);
  std::vector<at::Tensor> grads, terms;
  for (const bool checkpointed : {false, true}) {
    nn::MoE moe(o, at::TensorOptions().dtype(at::kFloat));
    moe->aux_loss_weight = 5.0;
    {
      at::NoGradGuard no_grad;
      at::Generator init = at::make_generator<at::CPUGeneratorImpl>(9);
      for (auto& p : moe->parameters()) p.copy_(at::randn(p.sizes(), init) * 0.3);
    }
    if (checkpointed) nn::apply_activation_checkpointing(*moe);
    const at::Tensor x = x0.clone().requires_grad_(true);
    moe->forward(x).sum().backward();  // checkpointed: the body runs again in backward
    EXPECT_EQ(moe->tokens_per_expert.sum().item<double>(), 20.0 * o.top_k);
    grads.push_back(moe->router->gate->weight.grad().clone());
    grads.push_back(x.grad().clone());
    terms.push_back(moe->aux_loss_terms.clone());
  }
  EXPECT_LT(test::relative_error(grads[2], grads[0]), 1e-6);
  EXPECT_LT(test::relative_error(grads[3], grads[1]), 1e-6);
  EXPECT_TRUE(at::equal(terms[1], terms[0])) << terms[1] << terms[0];
}

TEST(MoELayer, BadOptionsAreNamed) {
  nn::MoEOptions o = cases()[0].options;
  o.top_k = 9;
  EXPECT_NE(test::error_of([&] { o.validate(); }).find("top_k 9 must be between 1 and the number of experts 8"),
            std::string::npos);
  o = cases()[1].options;
  o.n_groups = 3;
  EXPECT_NE(test::error_of([&] { o.validate(); }).find("8 experts do not split into 3 groups"), std::string::npos);
  o = cases()[0].options;
  o.score_func = "relu";
  EXPECT_NE(test::error_of([&] { o.validate(); }).find("score_func 'relu'"), std::string::npos);
}

}  // namespace
}  // namespace titan
