// Activation memory of one Llama 3 8B block and of the loss, measured on the CPU with the counting
// allocator (titan/common/memory_tracker.h): titan's layers against the plain ATen formulation they
// replaced (at::rms_norm, complex RoPE through autograd, K/V repeated per query head, silu(h1) * h3
// through autograd, at::cross_entropy_loss on fp32 logits).
//
// "saved" is what the autograd graph keeps from forward to backward: bytes alive after a forward pass
// that records the graph minus bytes alive after the same pass without it (the block's input is
// built inside, so a saved input counts, as in a model). "peak" (loss only) is the most bytes alive
// over forward and backward above what was alive before (including the logits, built inside, and
// their gradient).
//
// usage: titan_bench_block_memory [seq_len ...]      (default: 64 128; batch 1)
// Modes: fp32; bf16 (bf16 parameters and activations, training.dtype bfloat16 on the CPU); bf16
// autocast (fp32 parameters and residual stream, matmuls and attention in bf16, as CUDA's autocast).
#include "titan/common/autocast.h"
#include "titan/common/memory_tracker.h"
#include "titan/nn/layers.h"
#include "titan/nn/loss.h"
#include "titan/models/llama3/model.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace {

using namespace titan;

// ---- the plain formulations (titan's layers before they were made lean)
at::Tensor plain_rope(const at::Tensor& x_BSnE, const at::Tensor& cis_SE2) {
  const auto B = x_BSnE.size(0), S = x_BSnE.size(1), n = x_BSnE.size(2), E = x_BSnE.size(3);
  at::Tensor x_c = at::view_as_complex(x_BSnE.to(at::kFloat).reshape({B, S, n, E / 2, 2}));
  return at::view_as_real(x_c * cis_SE2.view({1, S, 1, E / 2})).flatten(3).to(x_BSnE.scalar_type());
}

at::Tensor plain_block(llama3::TransformerBlock& b, const at::Tensor& x_BSD, const at::Tensor& cis_SE2) {
  const auto B = x_BSD.size(0), S = x_BSD.size(1), E = b->attention->head_dim;
  const auto& att = b->attention;
  const auto& ff = b->feed_forward;
  const int64_t D = x_BSD.size(2);
  at::Tensor xn = at::rms_norm(x_BSD, {D}, b->attention_norm->weight, b->attention_norm->eps);
  at::Tensor q_BSHE = plain_rope(at::linear(xn, att->wq->weight).view({B, S, -1, E}), cis_SE2);
  at::Tensor k_BSKE = plain_rope(at::linear(xn, att->wk->weight).view({B, S, -1, E}), cis_SE2);
  at::Tensor v_BSKE = at::linear(xn, att->wv->weight).view({B, S, -1, E});
  const auto H = q_BSHE.size(2), K = k_BSKE.size(2);
  k_BSKE = k_BSKE.unsqueeze(3).expand({B, S, K, H / K, E}).reshape({B, S, H, E});
  v_BSKE = v_BSKE.unsqueeze(3).expand({B, S, K, H / K, E}).reshape({B, S, H, E});
  at::Tensor o = at::scaled_dot_product_attention(q_BSHE.transpose(1, 2), k_BSKE.transpose(1, 2),
                                                  v_BSKE.transpose(1, 2), {}, 0.0, /*is_causal=*/true);
  at::Tensor h = x_BSD + at::linear(o.transpose(1, 2).contiguous().view({B, S, -1}), att->wo->weight);
  at::Tensor hn = at::rms_norm(h, {D}, b->ffn_norm->weight, b->ffn_norm->eps);
  return h + at::linear(at::silu(at::linear(hn, ff->w1->weight)) * at::linear(hn, ff->w3->weight), ff->w2->weight);
}

// ---- measurement

// Bytes the graph of f keeps alive; x is copied inside (x * 1) so that a saved input is charged.
int64_t saved_bytes(const std::function<at::Tensor(const at::Tensor&)>& f, const at::Tensor& x, bool autocast) {
  auto alive_after_forward = [&](bool record) {
    at::AutoGradMode mode(record);
    const int64_t before = mem::cpu_allocated_bytes();
    at::Tensor out;
    {
      Bf16Autocast ac(at::kCPU, autocast);
      out = f(x.mul(1));
    }
    return mem::cpu_allocated_bytes() - before;
  };
  return alive_after_forward(true) - alive_after_forward(false);
}

struct SavedAndPeak {
  int64_t saved, peak;
};

SavedAndPeak loss_memory(const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss,
                         const at::Tensor& logits, const at::Tensor& labels) {
  SavedAndPeak r{};
  {
    int64_t with = 0, without = 0;
    for (bool record : {true, false}) {
      at::AutoGradMode mode(record);
      const int64_t before = mem::cpu_allocated_bytes();
      at::Tensor l = loss(logits.mul(1), labels);
      (record ? with : without) = mem::cpu_allocated_bytes() - before;
    }
    r.saved = with - without;
  }
  logits.mutable_grad().reset();
  mem::PeakScope scope;
  {
    at::Tensor l = loss(logits.mul(1), labels);
    l.backward();
  }
  r.peak = scope.peak_above_start();
  logits.mutable_grad().reset();
  return r;
}

double mib(int64_t b) { return static_cast<double>(b) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> seq_lens;
  for (int i = 1; i < argc; ++i) seq_lens.push_back(std::atoll(argv[i]));
  if (seq_lens.empty()) seq_lens = {64, 128};
  mem::install_cpu_tracking();
  at::manual_seed(0);

  llama3::ModelArgs a = llama3::flavor("8B");
  std::printf("Llama 3 8B block: dim %lld, %lld heads over %lld key/value heads, SwiGLU hidden %lld; batch 1\n\n",
              static_cast<long long>(a.dim), static_cast<long long>(a.n_heads), static_cast<long long>(a.kv_heads()),
              static_cast<long long>(a.ffn_hidden_dim()));
  // Saved bytes at each sequence length; the per-token figure is the slope between the first and the
  // last length (under autocast the graph also keeps the bf16 copies of the weights, which do not
  // grow with the sequence).
  std::printf("| mode | seq_len | saved, plain (MiB) | saved, titan (MiB) | titan/plain |\n|---|---|---|---|---|\n");
  struct Mode {
    const char* name;
    at::ScalarType param_dtype;
    bool autocast;
  };
  std::vector<std::string> per_token;
  for (const Mode& m : {Mode{"fp32", at::kFloat, false}, Mode{"bf16", at::kBFloat16, false},
                        Mode{"bf16 autocast", at::kFloat, true}}) {
    llama3::TransformerBlock block(0, a, at::TensorOptions().dtype(m.param_dtype));
    {
      at::NoGradGuard no_grad;
      for (auto& p : block->parameters()) p.normal_(0.0, 0.02);
      block->attention_norm->reset_parameters();
      block->ffn_norm->reset_parameters();
    }
    std::vector<int64_t> plain, lean;
    for (int64_t S : seq_lens) {
      at::Tensor angles = at::outer(at::arange(S, at::kFloat), nn::rope_frequencies(a.head_dim(), a.rope_theta, std::nullopt));
      at::Tensor cis = at::polar(at::ones_like(angles), angles);
      at::Tensor x = at::randn({1, S, a.dim}).to(m.param_dtype).requires_grad_(true);
      plain.push_back(saved_bytes([&](const at::Tensor& in) { return plain_block(block, in, cis); }, x, m.autocast));
      lean.push_back(saved_bytes([&](const at::Tensor& in) { return block->forward(in, cis); }, x, m.autocast));
      std::printf("| %s | %lld | %.2f | %.2f | %.3f |\n", m.name, static_cast<long long>(S), mib(plain.back()),
                  mib(lean.back()), static_cast<double>(lean.back()) / static_cast<double>(plain.back()));
      std::fflush(stdout);
    }
    if (seq_lens.size() < 2) continue;
    const double dS = static_cast<double>(seq_lens.back() - seq_lens.front());
    const double p = static_cast<double>(plain.back() - plain.front()) / dS, l = static_cast<double>(lean.back() - lean.front()) / dS;
    char line[256];
    std::snprintf(line, sizeof line, "| %s | %.0f | %.0f | %.3f | %.2f | %.2f |", m.name, p, l, l / p,
                  p * 8192 / (1 << 30), l * 8192 / (1 << 30));
    per_token.push_back(line);
  }
  if (!per_token.empty()) {
    std::printf("\nPer token (slope between seq_len %lld and %lld), and that slope times 8192 tokens:\n\n",
                static_cast<long long>(seq_lens.front()), static_cast<long long>(seq_lens.back()));
    std::printf("| mode | plain (B/token) | titan (B/token) | titan/plain | plain x 8192 (GiB) | titan x 8192 (GiB) |\n"
                "|---|---|---|---|---|---|\n");
    for (const auto& l : per_token) std::printf("%s\n", l.c_str());
  }

  std::printf("\nLoss over Llama 3's vocabulary (%lld): saved for backward and peak over forward + backward\n\n",
              static_cast<long long>(a.vocab_size));
  std::printf("| logits | tokens | saved, plain (MiB) | saved, titan (MiB) | peak, plain (MiB) | peak, titan (MiB) |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (at::ScalarType dt : {at::kBFloat16, at::kFloat}) {
    for (int64_t N : {int64_t{1024}, int64_t{2048}}) {  // chunks of nn::kLossChunkTokens = 1024 tokens
      at::Tensor logits = (at::randn({N, a.vocab_size}) * 2).to(dt).requires_grad_(true);
      at::Tensor labels = at::randint(a.vocab_size, {N}, at::kLong);
      auto plain = loss_memory(
          [](const at::Tensor& l, const at::Tensor& y) {
            return at::cross_entropy_loss(l.to(at::kFloat), y, {}, at::Reduction::Sum);
          },
          logits, labels);
      auto lean = loss_memory([](const at::Tensor& l, const at::Tensor& y) { return nn::cross_entropy_sum(l, y); },
                              logits, labels);
      std::printf("| %s | %lld | %.2f | %.2f | %.2f | %.2f |\n", at::toString(dt), static_cast<long long>(N),
                  mib(plain.saved), mib(lean.saved), mib(plain.peak), mib(lean.peak));
      std::fflush(stdout);
    }
  }
  return 0;
}
