#include "titan/nn/moe.h"

#include "titan/common/autocast.h"
#include "titan/common/error.h"
#include "titan/common/meta_device.h"
#include "titan/common/tensor_storage.h"
#include "titan/nn/activation_checkpoint.h"
#include "titan/nn/float8.h"
#include "titan/nn/fused_kernels.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <limits>

namespace titan::nn {

void MoEOptions::validate() const {
  TITAN_USER_CHECK(dim > 0 && hidden_dim > 0 && num_experts > 0, "moe: dim, hidden_dim and num_experts must be positive");
  TITAN_USER_CHECK(top_k >= 1 && top_k <= num_experts, "moe: top_k ", top_k, " must be between 1 and the number of "
                   "experts ", num_experts);
  TITAN_USER_CHECK(score_func == "softmax" || score_func == "sigmoid", "moe: score_func '", score_func,
                   "' is neither softmax nor sigmoid");
  TITAN_USER_CHECK(num_shared_experts >= 0, "moe: num_shared_experts must not be negative");
  TITAN_USER_CHECK(aux_loss_coeff >= 0, "moe: aux_loss_coeff ", aux_loss_coeff, " must not be negative");
  if (n_groups > 1) {
    TITAN_USER_CHECK(num_experts % n_groups == 0 && num_experts / n_groups >= 2, "moe: ", num_experts,
                     " experts do not split into ", n_groups, " groups of at least 2");
    TITAN_USER_CHECK(topk_groups >= 1 && topk_groups <= n_groups, "moe: topk_groups ", topk_groups,
                     " must be between 1 and n_groups ", n_groups);
    TITAN_USER_CHECK(top_k <= topk_groups * (num_experts / n_groups), "moe: top_k ", top_k, " exceeds the ",
                     topk_groups * (num_experts / n_groups), " experts of the ", topk_groups, " groups kept");
  }
}

Routing route(const at::Tensor& logits_TE, const at::Tensor& expert_bias_E, const MoEOptions& o,
              bool force_load_balance) {
  Routing r;
  const at::Tensor logits = logits_TE.to(at::kFloat);
  r.scores_TE = o.score_func == "sigmoid" ? at::sigmoid(logits) : at::softmax(logits, -1);
  at::Tensor choice;
  {
    at::NoGradGuard no_grad;  // the choice is discrete: no gradient flows through it
    choice = r.scores_TE.detach();
    if (expert_bias_E.defined()) choice = choice + expert_bias_E.to(at::kFloat);
    if (o.n_groups > 1) {
      const int64_t T = choice.size(0), G = o.n_groups;
      const at::Tensor grouped = choice.view({T, G, -1});
      const at::Tensor group_scores = std::get<0>(grouped.topk(2, -1)).sum(-1);  // (T, G)
      const at::Tensor kept = std::get<1>(group_scores.topk(o.topk_groups, -1));  // (T, topk_groups)
      const at::Tensor keep = at::zeros({T, G}, choice.options().dtype(at::kBool)).scatter_(1, kept, true);
      choice = grouped.masked_fill(keep.logical_not().unsqueeze(-1), -std::numeric_limits<float>::infinity())
                   .view({T, -1});
    }
    r.ids_TK = force_load_balance
                   ? at::arange(choice.size(0) * o.top_k, choice.options().dtype(at::kLong)).view({-1, o.top_k})
                         .remainder(o.num_experts)
                   : std::get<1>(choice.topk(o.top_k, -1, /*largest=*/true, /*sorted=*/true));
    // On the meta device (shape-only dry runs) the counts have no values.
    // (A scatter of ones rather than bincount, which reads the ids' range on the host: no sync.)
    const at::Tensor flat = r.ids_TK.reshape({-1});
    r.counts_E = choice.is_meta() ? at::empty({o.num_experts}, r.ids_TK.options())
                                  : at::zeros({o.num_experts}, r.ids_TK.options()).scatter_add_(0, flat, at::ones_like(flat));
  }
  r.weights_TK = r.scores_TE.gather(-1, r.ids_TK);
  if (o.route_norm) r.weights_TK = r.weights_TK / (r.weights_TK.sum(-1, /*keepdim=*/true) + 1e-20);
  if (o.route_scale != 1.0) r.weights_TK = r.weights_TK * o.route_scale;
  return r;
}

at::Tensor aux_loss_term(const Routing& r, const at::Tensor& global_counts_E, const MoEOptions& o) {
  const at::Tensor counts = global_counts_E.to(at::kFloat);
  const at::Tensor tokens = counts.sum() / static_cast<double>(o.top_k);  // T of the global micro-batch
  const at::Tensor p_TE = o.score_func == "softmax" ? r.scores_TE : r.scores_TE / r.scores_TE.sum(-1, /*keepdim=*/true);
  return static_cast<double>(o.num_experts) * (counts * p_TE.sum(0)).sum() / (tokens * tokens);
}

namespace {

// y unchanged forward; backward passes y's gradient through and gives `aux` the gradient 1, so that
// the auxiliary loss is differentiated wherever the layer's output is.
struct AddAuxLossGradient : public torch::autograd::Function<AddAuxLossGradient> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& y, const at::Tensor& aux) {
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::ones({}, grads[0].options().dtype(at::kFloat))};
  }
};

// y[t] = sum over k of round(out[row[t * K + k]] * w[t * K + k]) (w undefined: weights of 1).
at::Tensor sum_rows(const at::Tensor& out_ND, const at::Tensor& row_N, const at::Tensor& w_N, int64_t K) {
  const int64_t T = row_N.numel() / K, D = out_ND.size(1);
  if (fused::moe_combine_accepts(out_ND, row_N, w_N, K)) return fused::moe_combine_forward(out_ND, row_N, w_N, K);
  if (out_ND.is_meta() && meta_is_cuda()) return at::empty({T, D}, out_ND.options());  // what the kernel allocates
  const at::ScalarType acc = at::promote_types(out_ND.scalar_type(), at::kFloat);  // fp32, or fp64 for fp64
  at::Tensor rows = out_ND.index_select(0, row_N).view({T, K, D});
  if (w_N.defined()) rows = (rows.to(acc) * w_N.view({T, K, 1})).to(out_ND.scalar_type());
  return rows.sum(1, /*keepdim=*/false, acc).to(out_ND.scalar_type());
}

// Forward: the copies' rows gathered from their tokens; backward: each token's K row gradients summed.
struct DispatchRows : public torch::autograd::Function<DispatchRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_TD, const at::Tensor& perm_N,
                            const at::Tensor& inv_N, int64_t K) {
    ctx->save_for_backward({inv_N});
    ctx->saved_data["K"] = K;
    return x_TD.index_select(0, perm_N.div(K, "floor"));  // (div has a meta kernel, floor_divide none)
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor inv_N = ctx->get_saved_variables()[0];
    return {sum_rows(grads[0], inv_N, at::Tensor(), ctx->saved_data["K"].toInt()), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

struct CombineRows : public torch::autograd::Function<CombineRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out_ND, const at::Tensor& w_N,
                            const at::Tensor& perm_N, const at::Tensor& inv_N, int64_t K) {
    ctx->save_for_backward({out_ND, w_N, perm_N, inv_N});
    ctx->saved_data["K"] = K;
    return sum_rows(out_ND, inv_N, w_N, K);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &out_ND = saved[0], &w_N = saved[1], &perm_N = saved[2], &inv_N = saved[3];
    const int64_t K = ctx->saved_data["K"].toInt(), N = inv_N.numel(), T = N / K, D = out_ND.size(1);
    const at::Tensor gy_TD = grads[0].to(out_ND.scalar_type());
    at::Tensor grad_out, grad_w;
    if (fused::moe_combine_accepts(out_ND, inv_N, w_N, K)) {
      std::tie(grad_out, grad_w) = fused::moe_combine_backward(gy_TD, out_ND, inv_N, w_N, K);
    } else if (out_ND.is_meta() && meta_is_cuda()) {  // what the kernel allocates
      grad_out = at::empty_like(out_ND);
      grad_w = at::empty({N}, w_N.options());
    } else {
      const at::Tensor g = gy_TD.to(w_N.scalar_type()).unsqueeze(1);  // (T, 1, D)
      grad_w = (g * out_ND.index_select(0, inv_N).view({T, K, D}).to(w_N.scalar_type())).sum(-1).reshape({N});
      grad_out = (g * w_N.view({T, K, 1})).to(out_ND.scalar_type()).view({N, D}).index_select(0, perm_N);
    }
    return {grad_out, grad_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

CopyOrder copy_order(const at::Tensor& perm_N) {
  return {perm_N, std::get<1>(perm_N.sort(/*stable=*/true, 0, /*descending=*/false))};
}

at::Tensor dispatch_rows(const at::Tensor& x_TD, const CopyOrder& order, int64_t K) {
  const at::Tensor& perm_N = order.perm_N;
  TITAN_ASSERT(x_TD.dim() == 2 && K > 0 && perm_N.dim() == 1 && perm_N.numel() == x_TD.size(0) * K,
               "MoE dispatch: x (T, D) and perm (T * K), got x ", x_TD.sizes(), ", perm ", perm_N.sizes(), ", K ", K);
  return DispatchRows::apply(x_TD, perm_N, order.inv_N, K);
}

at::Tensor combine_rows(const at::Tensor& out_ND, const at::Tensor& weights_TK, const CopyOrder& order) {
  const at::Tensor& perm_N = order.perm_N;
  TITAN_ASSERT(weights_TK.dim() == 2 && weights_TK.numel() == perm_N.numel() && out_ND.dim() == 2 &&
                   out_ND.size(0) == perm_N.numel(),
               "MoE combine: weights (T, K), out (T * K, D) and perm (T * K), got weights ", weights_TK.sizes(),
               ", out ", out_ND.sizes(), ", perm ", perm_N.sizes());
  // The products in fp32 (fp64 for fp64 rows), as the kernel computes them.
  const at::ScalarType acc = at::promote_types(out_ND.scalar_type(), at::kFloat);
  return CombineRows::apply(out_ND, weights_TK.to(acc).reshape({-1}), perm_N, order.inv_N, weights_TK.size(1));
}

at::Tensor grouped_linear(const at::Tensor& x_NI, const at::Tensor& w_EOI, const at::Tensor& counts_E, bool grouped) {
  const int64_t E = w_EOI.size(0);
  // Shapes only (the meta device): one matmul of every row, as if by one expert.
  if (x_NI.is_meta()) return at::matmul(x_NI, w_EOI[0].t());
  const int64_t elem = static_cast<int64_t>(x_NI.element_size());
  // at::_grouped_mm's kernels read rows at 16-byte strides (both operands, and the gradients').
  const bool aligned = (w_EOI.size(1) * elem) % 16 == 0 && (w_EOI.size(2) * elem) % 16 == 0;
  if (aligned && grouped) {
    const at::Tensor offsets = at::cumsum(counts_E, 0).to(at::kInt);
    return at::_grouped_mm(x_NI, w_EOI.transpose(-2, -1), offsets);
  }
  const at::Tensor counts = counts_E.to(at::kCPU);  // one read of E counts
  const int64_t* c = counts.data_ptr<int64_t>();
  std::vector<at::Tensor> outs;
  int64_t begin = 0;
  for (int64_t e = 0; e < E; ++e) {
    outs.push_back(at::matmul(x_NI.narrow(0, begin, c[e]), w_EOI[e].t()));
    begin += c[e];
  }
  return at::cat(outs, 0);
}

GroupedExpertsImpl::GroupedExpertsImpl(int64_t num_experts, int64_t dim, int64_t hidden_dim,
                                       const at::TensorOptions& opts, bool grouped_mm_)
    : grouped_mm(grouped_mm_) {
  w1 = register_parameter("w1", new_parameter({num_experts, hidden_dim, dim}, opts));
  w2 = register_parameter("w2", new_parameter({num_experts, dim, hidden_dim}, opts));
  w3 = register_parameter("w3", new_parameter({num_experts, hidden_dim, dim}, opts));
}

at::Tensor GroupedExpertsImpl::forward(const at::Tensor& x_ND, const at::Tensor& counts_E) {
  return with_hooks([&] {
    // Under autocast the grouped matmuls run in the autocast dtype, as Linear layers would.
    const at::ScalarType dtype = compute_dtype(x_ND);
    const at::Tensor x = x_ND.to(dtype);
    // Float8: the counts read on the host once for the three products and their backward. (A meta
    // tensor holds no counts: titan estimate's dry run takes the shapes of the plain path.)
    std::vector<int64_t> counts;
    if (float8 && !x.is_meta()) {
      const at::Tensor c = counts_E.to(at::kCPU, at::kLong).contiguous();
      counts.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
    }
    const auto linear = [&](const at::Tensor& in, const at::Tensor& w) {
      return float8 && !in.is_meta() ? float8_grouped_linear(in, w.to(dtype), counts, *float8)
                                     : grouped_linear(in, w.to(dtype), counts_E, grouped_mm);
    };
    const at::Tensor h = swiglu(linear(x, w1), linear(x, w3));
    return linear(h, w2);
  });
}

RouterImpl::RouterImpl(int64_t dim, int64_t num_experts, const at::TensorOptions& opts) {
  gate = register_module("gate", Linear(dim, num_experts, opts));
}

at::Tensor RouterImpl::forward(const at::Tensor& x_TD) {
  return with_hooks([&] { return gate(x_TD); });
}

MoEImpl::MoEImpl(MoEOptions options, const at::TensorOptions& opts) : options_(std::move(options)) {
  options_.validate();
  const MoEOptions& o = options_;
  router = register_module("router", Router(o.dim, o.num_experts, opts));
  experts = register_module("experts", GroupedExperts(o.num_experts, o.dim, o.hidden_dim, opts, o.grouped_mm));
  if (o.num_shared_experts > 0)
    shared_experts = register_module("shared_experts", FeedForward(o.dim, o.hidden_dim * o.num_shared_experts, opts));
  const at::TensorOptions buffer = opts.dtype(at::kFloat).requires_grad(false);
  if (o.expert_bias) expert_bias = register_buffer("expert_bias", at::zeros({o.num_experts}, buffer));
  tokens_per_expert = register_buffer("tokens_per_expert", at::zeros({o.num_experts}, buffer));
}

at::Tensor MoEImpl::forward(const at::Tensor& x_BSD) {
  return with_hooks({x_BSD}, [this](const std::vector<at::Tensor>& in) {
    const at::Tensor& x = in[0];
    const int64_t D = x.size(-1), K = options_.top_k;
    const at::Tensor x_TD = x.reshape({-1, D});
    const Routing r = route(router(x_TD), expert_bias, options_, force_load_balance);
    if (count_tokens && !recomputing() && tokens_per_expert.device().type() != at::kMeta) {
      at::NoGradGuard no_grad;
      tokens_per_expert.add_(r.counts_E.to(tokens_per_expert.device(), at::kFloat));
    }
    // The routed copies sorted by expert (stable: a token's copies keep the order of its choices).
    const CopyOrder order = copy_order(std::get<1>(r.ids_TK.reshape({-1}).sort(/*stable=*/true, 0, false)));
    const at::Tensor routed_ND = dispatch_rows(x_TD, order, K);
    at::Tensor out_ND;
    if (exchange) {
      const ExpertExchange ex = exchange(routed_ND, r.counts_E);
      out_ND = ex.back(experts(ex.x_ND, ex.counts_E));
    } else {
      out_ND = experts(routed_ND, r.counts_E);
    }
    at::Tensor y_TD = combine_rows(out_ND, r.weights_TK, order);
    if (shared_experts) y_TD = y_TD + shared_experts(x_TD).to(y_TD.scalar_type());
    if (aux_loss_weight > 0 && count_tokens) {
      at::Tensor counts;
      {
        at::NoGradGuard no_grad;
        counts = r.counts_E.to(at::kFloat);
        if (global_counts) counts = global_counts(counts);
      }
      const at::Tensor term = aux_loss_term(r, counts, options_);
      if (!recomputing()) {
        at::NoGradGuard no_grad;
        aux_loss_terms = aux_loss_terms.defined() ? aux_loss_terms + term.detach() : term.detach().clone();
      }
      if (at::GradMode::is_enabled()) y_TD = AddAuxLossGradient::apply(y_TD, term * aux_loss_weight);
    }
    return y_TD.view(x.sizes());
  });
}

void update_expert_bias(at::Tensor& expert_bias_E, const at::Tensor& counts_E, double rate) {
  at::NoGradGuard no_grad;
  const at::Tensor c = counts_E.to(at::kFloat);
  at::Tensor delta = at::sign(c.mean() - c) * rate;
  delta = delta - delta.mean();
  expert_bias_E.add_(delta.to(expert_bias_E.device(), expert_bias_E.scalar_type()));
}

}  // namespace titan::nn
