#include "titan/distributed/tensor_parallel.h"

#include "titan/common/error.h"
#include "titan/nn/float8.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <memory>

namespace titan::dist {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Group& group_of(AutogradContext* ctx) { return *reinterpret_cast<Group*>(ctx->saved_data["group"].toInt()); }
int64_t handle(Group& g) { return reinterpret_cast<int64_t>(&g); }

// Collectives along a tensor dimension: that dimension is moved first (a contiguous copy), where the
// group's flat collectives concatenate and split.
at::Tensor gather_along(const at::Tensor& x, Group& g, int64_t dim) {
  at::Tensor in = x.movedim(dim, 0).contiguous();
  at::Tensor out = at::empty({g.size() * in.numel()}, in.options());
  g.all_gather(out, in).wait();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] *= g.size();
  return out.view(shape).movedim(0, dim).contiguous();
}

at::Tensor scatter_along(const at::Tensor& x, Group& g, int64_t dim) {
  TITAN_ASSERT(x.size(dim) % g.size() == 0, "reduce-scatter of ", x.sizes(), " along dim ", dim, " over ", g.size(),
               " ranks");
  at::Tensor in = x.movedim(dim, 0).contiguous();
  at::Tensor out = at::empty({in.numel() / g.size()}, in.options());
  g.reduce_scatter(out, in).wait();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] /= g.size();
  return out.view(shape).movedim(0, dim).contiguous();
}

struct AllGatherFn : public torch::autograd::Function<AllGatherFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return gather_along(x, *reinterpret_cast<Group*>(group), dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {scatter_along(grads[0], group_of(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterFn : public torch::autograd::Function<ReduceScatterFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return scatter_along(x, *reinterpret_cast<Group*>(group), dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gather_along(grads[0], group_of(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor()};
  }
};

at::Tensor all_reduced(const at::Tensor& x, Group& g) {
  at::Tensor out = x.contiguous().clone();
  g.all_reduce(out).wait();
  return out;
}

struct CopyFn : public torch::autograd::Function<CopyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduced(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct AllReduceFn : public torch::autograd::Function<AllReduceFn> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, int64_t group) {
    return all_reduced(x, *reinterpret_cast<Group*>(group));
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct GatherSlicesFn : public torch::autograd::Function<GatherSlicesFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["size"] = x.size(dim);
    return gather_along(x, *reinterpret_cast<Group*>(group), dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt(), size = ctx->saved_data["size"].toInt();
    return {grads[0].narrow(dim, group_of(ctx).rank() * size, size).contiguous(), at::Tensor(), at::Tensor()};
  }
};

// ---- loss parallel

struct VocabParallelCrossEntropyFn : public torch::autograd::Function<VocabParallelCrossEntropyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits_NVn, const at::Tensor& labels_N,
                            int64_t group, int64_t vocab_begin, int64_t chunk) {
    Group& g = *reinterpret_cast<Group*>(group);
    const int64_t N = logits_NVn.size(0), Vn = logits_NVn.size(1);
    const auto f32 = logits_NVn.options().dtype(at::kFloat);
    at::Tensor lse_N = at::empty({N}, f32);
    at::Tensor loss = at::zeros({}, f32);
    for (int64_t a = 0; a < N; a += chunk) {
      const int64_t b = std::min(N, a + chunk);
      const at::Tensor x_CV = logits_NVn.slice(0, a, b);
      const at::Tensor y_C = labels_N.slice(0, a, b);
      const at::Tensor valid_C = y_C.ne(nn::kIgnoreIndex);
      const at::Tensor local_C = y_C - vocab_begin;
      const at::Tensor mine_C = valid_C.logical_and(local_C.ge(0)).logical_and(local_C.lt(Vn));
      // The row maxima over the whole vocabulary (an infinite one counts as 0, as at::logsumexp).
      at::Tensor max_C = x_CV.amax(1).to(at::kFloat);
      g.all_reduce(max_C, c10d::ReduceOp::MAX).wait();
      max_C.masked_fill_(max_C.abs() == INFINITY, 0.0);
      // Sums of exponentials and the target logit (held by one rank, 0 elsewhere): one all-reduce.
      at::Tensor stats_2C = at::empty({2, b - a}, f32);
      stats_2C[0].copy_((x_CV.to(at::kFloat) - max_C.unsqueeze(1)).exp_().sum(1));
      stats_2C[1].copy_(at::where(mine_C,
                                  x_CV.gather(1, local_C.clamp(0, Vn - 1).unsqueeze(1)).squeeze(1).to(at::kFloat), 0.0));
      g.all_reduce(stats_2C).wait();
      at::Tensor lse_C = stats_2C[0].log().add_(max_C);
      loss.add_(at::where(valid_C, lse_C - stats_2C[1], 0.0).sum());
      lse_N.slice(0, a, b).copy_(lse_C);
    }
    ctx->save_for_backward({logits_NVn});
    ctx->saved_data["labels"] = labels_N;
    ctx->saved_data["lse"] = lse_N;
    ctx->saved_data["begin"] = vocab_begin;
    ctx->saved_data["chunk"] = chunk;
    return loss;
  }

  // This rank's slice of g * (softmax(x) - onehot(y)); no communication.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor logits_NVn = ctx->get_saved_variables()[0];
    const at::Tensor labels_N = ctx->saved_data["labels"].toTensor();
    const at::Tensor lse_N = ctx->saved_data["lse"].toTensor();
    const int64_t begin = ctx->saved_data["begin"].toInt(), chunk = ctx->saved_data["chunk"].toInt();
    const at::Tensor g = grads[0].to(at::kFloat);
    const int64_t N = logits_NVn.size(0), Vn = logits_NVn.size(1);
    at::Tensor grad_NVn = at::empty_like(logits_NVn, at::MemoryFormat::Contiguous);
    for (int64_t a = 0; a < N; a += chunk) {
      const int64_t b = std::min(N, a + chunk);
      const at::Tensor y_C = labels_N.slice(0, a, b);
      const at::Tensor valid_C = y_C.ne(nn::kIgnoreIndex);
      const at::Tensor local_C = y_C - begin;
      const at::Tensor mine_C = valid_C.logical_and(local_C.ge(0)).logical_and(local_C.lt(Vn));
      at::Tensor p_CV = (logits_NVn.slice(0, a, b).to(at::kFloat) - lse_N.slice(0, a, b).unsqueeze(1)).exp_();
      p_CV.scatter_add_(1, local_C.clamp(0, Vn - 1).unsqueeze(1), mine_C.to(at::kFloat).neg_().unsqueeze(1));
      p_CV.mul_(at::where(valid_C, g, 0.0).unsqueeze(1));
      grad_NVn.slice(0, a, b).copy_(p_CV);
    }
    return {grad_NVn, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// ---- async TP

// Pieces of a sequence shard of `length` tokens: the largest count up to `wanted` that divides it.
int64_t chunk_count(int64_t length, int64_t wanted) {
  int64_t c = std::max<int64_t>(1, wanted);
  while (c > 1 && length % c != 0) --c;
  return c;
}

// x_BSnD's piece j of L tokens, sequence first and contiguous: (L, B, D).
at::Tensor seq_piece(const at::Tensor& x_BSnD, int64_t j, int64_t L) {
  return x_BSnD.slice(1, j * L, (j + 1) * L).movedim(1, 0).contiguous();
}

// The tokens of piece j of every rank's shard of a whole-sequence tensor (B, n·Sn, X): (B, n, L, X).
at::Tensor rank_pieces(const at::Tensor& t_BSX, int64_t n, int64_t j, int64_t L) {
  const int64_t B = t_BSX.size(0), S = t_BSX.size(1), X = t_BSX.size(2);
  return t_BSX.view({B, n, S / n, X}).slice(2, j * L, (j + 1) * L);
}

struct AllGatherMatmulFn : public torch::autograd::Function<AllGatherMatmulFn> {
  // inputs: x_BSnD, then the weights. Outputs: x W_iᵀ for each weight, then the gathered x.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x_BSnD, at::TensorList weights, int64_t group,
                               int64_t chunks) {
    Group& g = *reinterpret_cast<Group*>(group);
    const int64_t n = g.size(), B = x_BSnD.size(0), Sn = x_BSnD.size(1), D = x_BSnD.size(2);
    const int64_t c = chunk_count(Sn, chunks), L = Sn / c;
    // Every piece's all-gather is issued first; piece j's matmuls run while the later ones travel.
    std::vector<at::Tensor> bufs(c);
    std::vector<Work> works(c);
    for (int64_t j = 0; j < c; ++j) {
      at::Tensor in = seq_piece(x_BSnD, j, L);
      bufs[j] = at::empty({n * in.numel()}, in.options());
      works[j] = g.all_gather(bufs[j], in);
    }
    at::Tensor x_BSD = at::empty({B, n * Sn, D}, x_BSnD.options());
    variable_list outs;
    for (const auto& w : weights) outs.push_back(at::empty({B, n * Sn, w.size(0)}, x_BSnD.options()));
    for (int64_t j = 0; j < c; ++j) {
      works[j].wait();
      const at::Tensor piece_BnLD = bufs[j].view({n, L, B, D}).permute({2, 0, 1, 3});
      rank_pieces(x_BSD, n, j, L).copy_(piece_BnLD);
      for (size_t i = 0; i < weights.size(); ++i)
        rank_pieces(outs[i], n, j, L).copy_(at::linear(piece_BnLD, weights[i]));
      bufs[j].reset();
    }
    ctx->saved_data["group"] = group;
    ctx->saved_data["chunks"] = c;
    variable_list saved = {x_BSD};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    outs.push_back(x_BSD);
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Group& g = group_of(ctx);
    const int64_t c = ctx->saved_data["chunks"].toInt();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x_BSD = saved[0];
    const size_t k = saved.size() - 1;
    const int64_t n = g.size(), B = x_BSD.size(0), S = x_BSD.size(1), D = x_BSD.size(2), Sn = S / n, L = Sn / c;
    // Input gradient of piece j for every rank's tokens, reduce-scattered while piece j+1 computes.
    std::vector<at::Tensor> outs(c);
    std::vector<Work> works(c);
    for (int64_t j = 0; j < c; ++j) {
      at::Tensor piece_BnLD = grads[k].defined() ? rank_pieces(grads[k], n, j, L).to(x_BSD.scalar_type(), false, true)
                                                 : at::zeros({B, n, L, D}, x_BSD.options());
      for (size_t i = 0; i < k; ++i)
        if (grads[i].defined())
          piece_BnLD.add_(at::matmul(rank_pieces(grads[i], n, j, L), saved[i + 1].to(grads[i].scalar_type())));
      at::Tensor in = piece_BnLD.permute({1, 2, 0, 3}).contiguous();  // (n, L, B, D)
      outs[j] = at::empty({L * B * D}, in.options());
      works[j] = g.reduce_scatter(outs[j], in);
    }
    variable_list result(1);
    // Weight gradients while the last reduce-scatters travel.
    variable_list weight_grads;
    for (size_t i = 0; i < k; ++i)
      weight_grads.push_back(grads[i].defined()
                                 ? at::matmul(grads[i].flatten(0, 1).t(), x_BSD.flatten(0, 1).to(grads[i].scalar_type()))
                                       .to(saved[i + 1].scalar_type())
                                 : at::Tensor());
    at::Tensor grad_x = at::empty({B, Sn, D}, x_BSD.options());
    for (int64_t j = 0; j < c; ++j) {
      works[j].wait();
      grad_x.slice(1, j * L, (j + 1) * L).copy_(outs[j].view({L, B, D}).movedim(0, 1));
    }
    // One gradient per input: x, each weight (a list input counts each tensor), group, chunks.
    result[0] = grad_x;
    for (auto& wg : weight_grads) result.push_back(wg);
    result.push_back(at::Tensor());
    result.push_back(at::Tensor());
    return result;
  }
};

struct MatmulReduceScatterFn : public torch::autograd::Function<MatmulReduceScatterFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_BSF, const at::Tensor& weight, int64_t group,
                            int64_t chunks) {
    Group& g = *reinterpret_cast<Group*>(group);
    const int64_t n = g.size(), B = x_BSF.size(0), S = x_BSF.size(1), D = weight.size(0);
    TITAN_ASSERT(S % n == 0, "matmul_reduce_scatter: sequence ", S, " over ", n, " ranks");
    const int64_t Sn = S / n, c = chunk_count(Sn, chunks), L = Sn / c;
    std::vector<at::Tensor> outs(c);
    std::vector<Work> works(c);
    for (int64_t j = 0; j < c; ++j) {
      at::Tensor y_nLBD = at::linear(rank_pieces(x_BSF, n, j, L), weight).permute({1, 2, 0, 3}).contiguous();
      outs[j] = at::empty({L * B * D}, y_nLBD.options());
      works[j] = g.reduce_scatter(outs[j], y_nLBD);
    }
    at::Tensor out = at::empty({B, Sn, D}, x_BSF.options());
    for (int64_t j = 0; j < c; ++j) {
      works[j].wait();
      out.slice(1, j * L, (j + 1) * L).copy_(outs[j].view({L, B, D}).movedim(0, 1));
    }
    ctx->saved_data["group"] = group;
    ctx->saved_data["chunks"] = c;
    ctx->save_for_backward({x_BSF, weight});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Group& g = group_of(ctx);
    const int64_t c = ctx->saved_data["chunks"].toInt();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x_BSF = saved[0], &weight = saved[1];
    const at::Tensor& g_BSnD = grads[0];
    const int64_t n = g.size(), B = g_BSnD.size(0), Sn = g_BSnD.size(1), D = g_BSnD.size(2), L = Sn / c;
    std::vector<at::Tensor> bufs(c);
    std::vector<Work> works(c);
    for (int64_t j = 0; j < c; ++j) {
      at::Tensor in = seq_piece(g_BSnD, j, L);
      bufs[j] = at::empty({n * in.numel()}, in.options());
      works[j] = g.all_gather(bufs[j], in);
    }
    // Under autocast the activations and their gradients are bf16 while the weight is fp32: the
    // matmuls run in the gradient's dtype, the weight gradient is returned in the weight's.
    const at::Tensor w = weight.to(g_BSnD.scalar_type());
    const at::Tensor x = x_BSF.to(g_BSnD.scalar_type());
    at::Tensor grad_x = at::empty(x_BSF.sizes(), x_BSF.options().dtype(g_BSnD.scalar_type()));
    at::Tensor grad_w = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
    for (int64_t j = 0; j < c; ++j) {
      works[j].wait();
      const at::Tensor g_BnLD = bufs[j].view({n, L, B, D}).permute({2, 0, 1, 3});
      rank_pieces(grad_x, n, j, L).copy_(at::matmul(g_BnLD, w));
      grad_w.add_(at::matmul(g_BnLD.reshape({-1, D}).t(), rank_pieces(x, n, j, L).reshape({-1, x.size(2)})));
      bufs[j].reset();
    }
    return {grad_x.to(x_BSF.scalar_type()), grad_w.to(weight.scalar_type()), at::Tensor(), at::Tensor()};
  }
};

constexpr int64_t kAsyncChunks = 4;

}  // namespace

at::Tensor tp_all_gather(const at::Tensor& x, Group& group, int64_t dim) { return AllGatherFn::apply(x, handle(group), dim); }
at::Tensor tp_reduce_scatter(const at::Tensor& x, Group& group, int64_t dim) {
  return ReduceScatterFn::apply(x, handle(group), dim);
}
at::Tensor tp_copy(const at::Tensor& x, Group& group) { return CopyFn::apply(x, handle(group)); }
at::Tensor tp_all_reduce(const at::Tensor& x, Group& group) { return AllReduceFn::apply(x, handle(group)); }
at::Tensor tp_gather_slices(const at::Tensor& x, Group& group, int64_t dim) {
  return GatherSlicesFn::apply(x, handle(group), dim);
}

at::Tensor vocab_parallel_cross_entropy_sum(const at::Tensor& logits_NVn, const at::Tensor& labels_N, Group& group,
                                            int64_t vocab_begin, int64_t chunk_tokens) {
  TORCH_CHECK(logits_NVn.dim() == 2 && labels_N.dim() == 1 && labels_N.size(0) == logits_NVn.size(0),
              "vocab_parallel_cross_entropy_sum takes logits (N, V/n) and labels (N,), got ", logits_NVn.sizes(),
              " and ", labels_N.sizes());
  TORCH_CHECK(chunk_tokens > 0, "vocab_parallel_cross_entropy_sum: chunk_tokens must be positive");
  return VocabParallelCrossEntropyFn::apply(logits_NVn, labels_N, handle(group), vocab_begin, chunk_tokens);
}

std::vector<at::Tensor> all_gather_matmul(const at::Tensor& x_BSnD, const std::vector<at::Tensor>& weights,
                                          Group& group, int64_t chunks) {
  TITAN_ASSERT(x_BSnD.dim() == 3 && !weights.empty(), "all_gather_matmul takes (B, S/n, D) and weights");
  return AllGatherMatmulFn::apply(x_BSnD, at::TensorList(weights), handle(group), chunks);
}

at::Tensor matmul_reduce_scatter(const at::Tensor& x_BSF, const at::Tensor& weight, Group& group, int64_t chunks) {
  TITAN_ASSERT(x_BSF.dim() == 3, "matmul_reduce_scatter takes (B, S, F)");
  return MatmulReduceScatterFn::apply(x_BSF, weight, handle(group), chunks);
}

// ---- styles

void check_sequence_length(int64_t seq_len, int64_t tp, bool sequence_parallel, const char* key) {
  TITAN_USER_CHECK(!sequence_parallel || tp <= 1 || seq_len % tp == 0, key, " ", seq_len,
                   " is not divisible by parallelism.tensor_parallel_degree ", tp,
                   ": sequence parallelism splits every sequence evenly across the tensor-parallel ranks; choose "
                   "a multiple of ", tp, " or set parallelism.enable_sequence_parallel false");
}

TensorParallel::TensorParallel(Group& group, TensorParallelOptions options) : group_(group), options_(options) {
  TITAN_USER_CHECK(!options_.async || options_.sequence_parallel,
                   "parallelism.enable_async_tensor_parallel decomposes sequence parallel's all-gathers and "
                   "reduce-scatters: it needs parallelism.enable_sequence_parallel true");
}

Placement TensorParallel::shard(at::Tensor& param, int64_t dim) const {
  return shard_in_place(param, dim, group_.name(), group_.rank(), group_.size());
}

// A float8 layer split along logical dim `dim` over the group (nn/float8.h): its amaxes completed by
// an all-reduce (MAX) over the group, so that every rank casts as one device would.
std::shared_ptr<const nn::Float8Sharding> TensorParallel::float8_split(char dim) {
  std::shared_ptr<const nn::Float8Sharding>& split = float8_splits_[dim];
  if (!split) {
    auto s = std::make_shared<nn::Float8Sharding>();
    s->dim = dim;
    Group* g = &group_;
    s->max_over_ranks = [g](at::Tensor& amax) { g->all_reduce(amax, c10d::ReduceOp::MAX).wait(); };
    split = std::move(s);
  }
  return split;
}

// A float8 layer's local weight must keep float8 matmuls' multiples of 16 (CUDA's kernels).
void check_float8_shard(const nn::LinearImpl& linear, int tp) {
  if (!linear.float8) return;
  const int64_t out = linear.weight.size(0), in = linear.weight.size(1);
  TITAN_USER_CHECK(out % 16 == 0 && in % 16 == 0, "a float8 linear layer of ", in, " -> ", out,
                   " features per tensor-parallel rank (tp ", tp, ") breaks float8 matmuls' multiples of 16: "
                   "choose another parallelism.tensor_parallel_degree or keep the layer in high precision with "
                   "quantize.linear.float8.filter_fqns");
}

std::vector<std::pair<std::string, Placement>> TensorParallel::column_wise(nn::LinearImpl& linear) {
  if (linear.float8) linear.float8_sharding = float8_split('N');
  std::vector<std::pair<std::string, Placement>> out = {{"weight", shard(linear.weight, 0)}};
  // The bias of the rows this rank computes.
  if (linear.bias.defined()) out.push_back({"bias", shard(linear.bias, 0)});
  check_float8_shard(linear, degree());
  return out;
}

std::vector<std::pair<std::string, Placement>> TensorParallel::row_wise(nn::LinearImpl& linear) {
  if (linear.float8) linear.float8_sharding = float8_split('K');
  std::vector<std::pair<std::string, Placement>> out = {{"weight", shard(linear.weight, 1)}};
  // The whole bias on every rank, added once after the reduction of the partial outputs (region()):
  // its gradient is partial over tp under sequence parallelism (each rank's tokens), like a norm's.
  if (linear.bias.defined()) out.push_back({"bias", whole(linear.bias, {group_.name()}, group_.rank() == 0)});
  check_float8_shard(linear, degree());
  return out;
}

std::vector<std::pair<std::string, Placement>> TensorParallel::vocabulary(nn::EmbeddingImpl& embedding) {
  Placement p = shard(embedding.weight, 0);
  const int64_t begin = p.shards[0].offset, rows = p.shards[0].length;
  // A token outside this rank's rows looks up row 0 and gets zeros; the sum over ranks is the lookup.
  embedding.set_forward_wrapper([begin, rows](const nn::HookedModule::Body& body, const std::vector<at::Tensor>& in) {
    const at::Tensor local = in[0] - begin;
    const at::Tensor outside = local.lt(0).logical_or(local.ge(rows));
    return body({local.masked_fill(outside, 0)}).masked_fill(outside.unsqueeze(-1), 0.0);
  });
  reduce_output(embedding);
  return {{"weight", p}};
}

std::vector<std::pair<std::string, Placement>> TensorParallel::replicated(torch::nn::Module& module) {
  // A replicated float8 layer on sequence-sharded tokens (an MoE router under sequence parallel).
  if (options_.sequence_parallel)
    for (const auto& m : module.modules(/*include_self=*/true))
      if (auto* linear = dynamic_cast<nn::LinearImpl*>(m.get()); linear && linear->float8)
        linear->float8_sharding = float8_split('M');
  std::vector<std::pair<std::string, Placement>> out;
  for (const auto& p : module.named_parameters())
    out.push_back({p.key(), whole(p.value(), {group_.name()}, group_.rank() == 0)});
  return out;
}

void TensorParallel::region(nn::HookedModule& module, const std::vector<nn::LinearImpl*>& first,
                            nn::LinearImpl& last) {
  Group* g = &group_;
  // The region's output is the last layer's, a partial sum until reduced: its bias goes on after.
  nn::LinearImpl* l = &last;
  l->bias_added_after = l->bias.defined();
  auto add_bias = [l](const at::Tensor& out) {
    return l->bias.defined() ? out + l->bias.to(out.scalar_type()) : out;
  };
  if (!options_.sequence_parallel) {
    module.add_forward_input_hook([g](std::vector<at::Tensor> in) {
      in[0] = tp_copy(in[0], *g);
      return in;
    });
    module.add_forward_hook([g, add_bias](const at::Tensor& out) { return add_bias(tp_all_reduce(out, *g)); });
    return;
  }
  if (!options_.async) {
    module.add_forward_input_hook([g](std::vector<at::Tensor> in) {
      in[0] = tp_all_gather(in[0], *g, 1);
      return in;
    });
    module.add_forward_hook([g, add_bias](const at::Tensor& out) { return add_bias(tp_reduce_scatter(out, *g, 1)); });
    return;
  }
  // Async: the region's input hook gathers and computes every first layer's output in pieces; the
  // layers then hand out those outputs instead of computing them. The last layer reduce-scatters
  // its own output in pieces.
  auto pending = std::make_shared<std::vector<at::Tensor>>(first.size());
  module.add_forward_input_hook([g, first, pending](std::vector<at::Tensor> in) {
    std::vector<at::Tensor> weights;
    for (auto* l : first) weights.push_back(l->weight);
    std::vector<at::Tensor> outs = all_gather_matmul(in[0], weights, *g, kAsyncChunks);
    for (size_t i = 0; i < first.size(); ++i) (*pending)[i] = outs[i];
    in[0] = outs.back();  // the gathered input: the region's code reads the whole sequence's shape
    return in;
  });
  for (size_t i = 0; i < first.size(); ++i) {
    nn::LinearImpl* f = first[i];
    f->set_forward_wrapper([pending, i, f](const nn::HookedModule::Body& body, const std::vector<at::Tensor>& in) {
      at::Tensor out = std::move((*pending)[i]);
      (*pending)[i] = at::Tensor();
      if (!out.defined()) return body(in);
      return f->bias.defined() ? out + f->bias.to(out.scalar_type()) : out;  // the fused product has none
    });
  }
  last.set_forward_wrapper([g, l, add_bias](const nn::HookedModule::Body&, const std::vector<at::Tensor>& in) {
    return add_bias(matmul_reduce_scatter(in[0], l->weight, *g, kAsyncChunks));
  });
}

void TensorParallel::reduce_output(nn::HookedModule& module) {
  Group* g = &group_;
  if (options_.sequence_parallel)
    module.add_forward_hook([g](const at::Tensor& out) { return tp_reduce_scatter(out, *g, 1); });
  else
    module.add_forward_hook([g](const at::Tensor& out) { return tp_all_reduce(out, *g); });
}

void TensorParallel::gather_output(nn::HookedModule& module) {
  Group* g = &group_;
  if (options_.sequence_parallel)
    module.add_forward_hook([g](const at::Tensor& out) { return tp_all_gather(out, *g, 1); });
  else
    module.add_forward_hook([g](const at::Tensor& out) { return tp_copy(out, *g); });
}

void TensorParallel::gather_logits(nn::HookedModule& module) {
  Group* g = &group_;
  module.add_forward_hook([g](const at::Tensor& out) { return tp_gather_slices(out, *g, out.dim() - 1); });
}

}  // namespace titan::dist
