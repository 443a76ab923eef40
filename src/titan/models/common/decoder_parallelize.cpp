#include "titan/models/common/decoder_parallelize.h"

#include "titan/common/error.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/expert_parallel.h"
#include "titan/distributed/tensor_parallel.h"
#include "titan/nn/activation_checkpoint.h"
#include "titan/nn/loss.h"
#include "titan/models/common/decoder.h"

namespace titan {
namespace {

void check_tensor_parallel_degree(const DecoderArgs& a, int64_t tp) {
  auto fits = [&](int64_t size, const char* what) {
    TITAN_USER_CHECK(size % tp == 0, "parallelism.tensor_parallel_degree ", tp, " does not divide the model's ", what,
                     " ", size, ": tensor parallelism splits them evenly across ranks; choose a degree that divides "
                     "n_heads ", a.n_heads, ", n_kv_heads ", a.kv_heads(), ", the feed-forward hidden size ",
                     a.ffn_hidden_dim(), " and the vocabulary ", a.vocab_size);
  };
  fits(a.n_heads, "n_heads");
  fits(a.kv_heads(), "n_kv_heads");
  fits(a.ffn_hidden_dim(), "feed-forward hidden size");
  fits(a.vocab_size, "vocabulary size");
}

// Tensor parallelism: shards the parameters, puts the communication around the modules and tells
// the data-parallel layer each parameter's placement.
void apply_tensor_parallel(DecoderImpl& model, dist::TensorParallel& tp, dist::DataParallel& dp) {
  check_tensor_parallel_degree(model.args(), tp.degree());
  model.keep_global_shapes();
  auto place = [&](const std::string& prefix, const std::vector<std::pair<std::string, dist::Placement>>& placed) {
    for (const auto& [name, p] : placed) {
      dp.set_placement(prefix + name, p);
      // A replicated weight that sees only its rank's tokens (sequence parallel) has a partial gradient.
      if (p.shards.empty() && tp.replicated_grads_partial()) dp.add_grad_sum(prefix + name, tp.group());
    }
  };
  if (model.tok_embeddings) place("tok_embeddings.", tp.vocabulary(*model.tok_embeddings));
  // Replicated weights that only this rank's heads use the output of: their gradients are partial
  // sums over tp, with or without sequence parallelism.
  auto summed_over_tp = [&](const std::string& prefix, torch::nn::Module& module) {
    // Their output gradients are partial sums over tp (each rank's heads' share): a float8 cast of a
    // partial sum is not the cast of the sum one device would make.
    const auto* linear = dynamic_cast<const nn::LinearImpl*>(&module);
    TITAN_USER_CHECK(!linear || !linear->float8, "float8 linear layer ", prefix.substr(0, prefix.size() - 1),
                     " under tensor parallelism: the gradient of its output is a partial sum over the tensor-parallel "
                     "ranks, which a float8 cast cannot take as one device would; keep it in high precision with "
                     "quantize.linear.float8.filter_fqns (e.g. \"wq_a\", \"wkv_a\")");
    for (const auto& [name, p] : tp.replicated(module)) {
      dp.set_placement(prefix + name, p);
      dp.add_grad_sum(prefix + name, tp.group());
    }
  };
  for (const auto& [pre, block_ptr] : model.blocks()) {
    auto& block = *block_ptr;
    place(pre + "attention_norm.", tp.replicated(*block.attention_norm));
    if (block.latent_attention) {
      // Multi-head latent attention: the latents (wq_a, wkv_a and their norms) replicated, the
      // per-head projections (wq or wq_b, wkv_b) column-wise, wo row-wise.
      auto& mla = *block.latent_attention;
      if (mla.wq) {
        place(pre + "attention.wq.", tp.column_wise(*mla.wq));
      } else {
        summed_over_tp(pre + "attention.wq_a.", *mla.wq_a);
        summed_over_tp(pre + "attention.q_norm.", *mla.q_norm);
        place(pre + "attention.wq_b.", tp.column_wise(*mla.wq_b));
      }
      summed_over_tp(pre + "attention.wkv_a.", *mla.wkv_a);
      summed_over_tp(pre + "attention.kv_norm.", *mla.kv_norm);
      place(pre + "attention.wkv_b.", tp.column_wise(*mla.wkv_b));
      place(pre + "attention.wo.", tp.row_wise(*mla.wo));
      tp.region(mla, {mla.wq ? mla.wq.get() : mla.wq_a.get(), mla.wkv_a.get()}, *mla.wo);
    }
    if (block.attention) {
      auto& attn = *block.attention;
      place(pre + "attention.wq.", tp.column_wise(*attn.wq));
      place(pre + "attention.wk.", tp.column_wise(*attn.wk));
      place(pre + "attention.wv.", tp.column_wise(*attn.wv));
      place(pre + "attention.wo.", tp.row_wise(*attn.wo));
      if (attn.q_norm) {  // each rank normalizes its own heads
        summed_over_tp(pre + "attention.q_norm.", *attn.q_norm);
        summed_over_tp(pre + "attention.k_norm.", *attn.k_norm);
      }
      tp.region(attn, {attn.wq.get(), attn.wk.get(), attn.wv.get()}, *attn.wo);
    }
    place(pre + "ffn_norm.", tp.replicated(*block.ffn_norm));
    if (block.moe) {
      // A MoE layer is not split: each rank routes the tokens it holds (under sequence parallelism
      // its part of the sequence, so the router, experts and shared experts see 1/tp of the tokens
      // and their gradients are partial sums over tp; without it every rank computes all of them).
      place(pre + "moe.", tp.replicated(*block.moe));
      continue;
    }
    auto& ffn = *block.feed_forward;
    place(pre + "feed_forward.w1.", tp.column_wise(*ffn.w1));
    place(pre + "feed_forward.w3.", tp.column_wise(*ffn.w3));
    place(pre + "feed_forward.w2.", tp.row_wise(*ffn.w2));
    tp.region(ffn, {ffn.w1.get(), ffn.w3.get()}, *ffn.w2);
  }
  if (model.norm) {
    place("norm.", tp.replicated(*model.norm));
    tp.gather_output(*model.norm);
  }
  if (model.output) place("output.", tp.column_wise(*model.output));  // tied: the embedding's shard
  if (!tp.options().loss_parallel && model.holds_output()) tp.gather_logits(model);
}

// Expert parallelism: each MoE layer keeps its ep rank's experts and exchanges the routed tokens.
void apply_expert_parallel(DecoderImpl& model, dist::ExpertParallel& ep, dist::DataParallel& dp,
                           dist::TensorParallel* tp) {
  TITAN_USER_CHECK(model.args().moe, "parallelism.expert_parallel_degree ", ep.degree(), " needs a "
                   "mixture-of-experts model (routed experts to spread over ranks); this model has none: set it to 1");
  model.keep_global_shapes();
  for (const auto& [pre, block] : model.blocks()) {
    if (!block->moe) continue;
    for (auto [name, p] : ep.shard(*block->moe->experts)) {
      if (tp) {  // the same experts on every tensor-parallel rank (see apply_tensor_parallel)
        p.replicated.push_back(tp->group().name());
        p.primary = tp->group().rank() == 0;
      }
      dp.set_placement(pre + "moe.experts." + name, p);
    }
    block->moe->exchange = [&ep](const at::Tensor& routed_ND, const at::Tensor& counts_E) {
      return ep.exchange(routed_ND, counts_E);
    };
  }
}

}  // namespace

ParallelizedModel parallelize_decoder(LanguageModelImpl& model, const ParallelizeContext& ctx) {
  auto* transformer = dynamic_cast<DecoderImpl*>(&model);
  TITAN_ASSERT(transformer, "parallelize_decoder needs a DecoderImpl");
  ParallelizedModel out;
  out.loss_sum = [](const at::Tensor& logits, const at::Tensor& labels) { return nn::cross_entropy_sum(logits, labels); };

  if (dist::TensorParallel* tp = ctx.tensor_parallel) {
    TITAN_ASSERT(ctx.data_parallel, "tensor parallelism needs the data-parallel layer (none is one)");
    apply_tensor_parallel(*transformer, *tp, *ctx.data_parallel);
    if (tp->options().loss_parallel) {
      dist::Group* group = &tp->group();
      const int64_t vocab_begin = group->rank() * (transformer->args().vocab_size / group->size());
      out.loss_sum = [group, vocab_begin](const at::Tensor& logits, const at::Tensor& labels) {
        return dist::vocab_parallel_cross_entropy_sum(logits, labels, *group, vocab_begin);
      };
    }
  }

  if (dist::ExpertParallel* ep = ctx.expert_parallel) {
    TITAN_ASSERT(ctx.data_parallel, "expert parallelism needs the data-parallel layer");
    apply_expert_parallel(*transformer, *ep, *ctx.data_parallel, ctx.tensor_parallel);
  }

  // Context parallelism: RoPE follows the rank's positions, attention runs over every rank's keys.
  if (dist::ContextParallel* cp = ctx.context_parallel) {
    transformer->set_sequence_positions(cp->degree(), [cp](int64_t seq_len) { return cp->positions(seq_len); });
    for (const auto& [prefix, block] : transformer->blocks()) {
      auto ring = [cp](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) { return cp->attention(q, k, v); };
      if (block->attention) {
        block->attention->attend = ring;
        block->attention->kernels = cp->attention_kernels();
      } else {
        block->latent_attention->attend = ring;
        block->latent_attention->kernels = cp->attention_kernels();
      }
    }
  }

  // Activation checkpointing inside the data-parallel hooks: recomputation in backward gathers no
  // parameters again (TP's collectives inside a block are recomputed with it).
  if (ctx.ac_mode != "none") {
    TITAN_ASSERT(ctx.ac_mode == "full" || ctx.ac_mode == "op" || ctx.ac_mode == "op_all_matmuls" ||
                     (ctx.ac_mode == "selective" && ctx.ac_every >= 1) || ctx.ac_mode == "per_block",
                 "AC mode ", ctx.ac_mode, " (memory_budget is resolved into per_block before parallelizing)");
    // Counted by layer id, so that a pipeline stage checkpoints the blocks the whole model would.
    for (const auto& [prefix, block] : transformer->blocks()) {
      const int64_t id = std::stoll(prefix.substr(7));
      std::string mode = ctx.ac_mode;
      if (mode == "selective") mode = (id + 1) % ctx.ac_every == 0 ? "full" : "none";
      if (mode == "per_block") {
        TITAN_ASSERT(id < static_cast<int64_t>(ctx.ac_block_modes.size()), "no checkpointing mode for block ", id);
        mode = ctx.ac_block_modes[id];
      }
      if (mode == "none") continue;
      TITAN_ASSERT(mode == "full" || mode == "op" || mode == "op_all_matmuls", "block AC mode ", mode);
      nn::CheckpointOptions options;
      options.save = mode == "op"               ? nn::SaveOps::EveryOtherMatmul
                     : mode == "op_all_matmuls" ? nn::SaveOps::AllMatmuls
                                                : nn::SaveOps::None;
      options.check_recompute = ctx.ac_check_recompute;
      options.name = prefix.substr(0, prefix.size() - 1);
      if (mode != "full") nn::force_recompute_linears(*block, prefix, ctx.ac_force_recompute);
      nn::apply_activation_checkpointing(*block, options);
    }
  }

  // Without a data-parallel layer (a plain model in one process) the parameters stay as they are.
  if (!ctx.data_parallel) return out;
  dist::DataParallel& dp = *ctx.data_parallel;
  // Units as torchtitan makes them: each block, the last one kept gathered after the forward (its
  // backward comes right after, so resharding it would only gather it again at once); [norm,
  // output] together, kept too, and apart from the embedding so that its reduce-scatter starts as
  // soon as the output layer's backward is done; the root (the embedding) last.
  const auto blocks = transformer->blocks();
  // Under expert parallelism a MoE layer's experts are a unit of their own, on the expert shard group.
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (ctx.expert_parallel && blocks[i].second->moe)
      dp.add_expert_unit({{blocks[i].first + "moe.experts.", blocks[i].second->moe->experts.get()}});
    dp.add_unit({{blocks[i].first, blocks[i].second}}, /*keep_after_forward=*/i + 1 == blocks.size());
  }
  std::vector<dist::UnitPart> head;
  if (transformer->norm) head.push_back({"norm.", transformer->norm.get()});
  if (transformer->output) head.push_back({"output.", transformer->output.get()});
  if (!head.empty()) dp.add_unit(head, /*keep_after_forward=*/true);
  dp.add_unit({{"", transformer}});  // the root: the embedding (a pipeline stage may have none)
  dp.finish(model);
  return out;
}

}  // namespace titan
