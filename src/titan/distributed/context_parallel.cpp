#include "titan/distributed/context_parallel.h"

#include "titan/common/error.h"
#include "titan/common/trace.h"
#include "titan/distributed/mesh.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <optional>
#include <tuple>

namespace titan::dist {

void check_context_parallel_sequence(int64_t seq_len, int64_t cp, bool load_balance, int64_t tp,
                                     bool sequence_parallel, const char* key) {
  if (cp <= 1) return;
  const int64_t chunks = load_balance ? 2 * cp : cp;
  TITAN_USER_CHECK(seq_len % chunks == 0, key, " ", seq_len, " is not divisible by ", chunks,
                   load_balance ? " (2 x parallelism.context_parallel_degree " : " (parallelism.context_parallel_degree ",
                   load_balance ? std::to_string(cp) + "): with load balancing (context_parallel_load_balancer "
                                  "\"headtail\") every sequence is cut into 2 x cp equal chunks"
                                : std::to_string(cp) + "): every sequence is cut into cp equal chunks",
                   "; choose a sequence length that is a multiple of ", chunks);
  const int64_t local = seq_len / cp;
  TITAN_USER_CHECK(!sequence_parallel || tp <= 1 || local % tp == 0, key, " ", seq_len, " gives each of the ", cp,
                   " context-parallel ranks ", local, " tokens, which sequence parallelism cannot split evenly over ",
                   "parallelism.tensor_parallel_degree ", tp, ": choose a multiple of ", cp * tp * (load_balance ? 2 : 1),
                   " or set parallelism.enable_sequence_parallel false");
}

ContextParallelOptions context_parallel_options(const std::string& load_balancer, const std::string& rotate_method) {
  ContextParallelOptions o;
  TITAN_USER_CHECK(load_balancer != "ptrr", "parallelism.context_parallel_load_balancer \"ptrr\" balances per-document "
                   "(flex) attention masks, which titan does not have (its attention is causal over whole sequences): "
                   "use \"headtail\" (the default) or \"none\"");
  TITAN_USER_CHECK(load_balancer == "headtail" || load_balancer == "none",
                   "parallelism.context_parallel_load_balancer \"", load_balancer,
                   "\" is not one of \"headtail\", \"none\"");
  o.load_balance = load_balancer == "headtail";
  TITAN_USER_CHECK(rotate_method == "allgather" || rotate_method == "alltoall",
                   "parallelism.context_parallel_rotate_method \"", rotate_method,
                   "\" is not one of \"allgather\", \"alltoall\"");
  o.rotate = rotate_method;
  return o;
}

namespace {

// Which part of the attention of this rank's queries over source rank j's keys (the i-th block
// of the ring, j = rank - i) is not masked out: query rows [q0, q0 + nq), key rows [k0, k0 + nk),
// causally or in full. Local sequences hold chunks in ascending global order, so the own block is
// plain causal attention. Under headtail (chunks r and 2cp-1-r): a lower source's first chunk
// precedes both of this rank's chunks and its second chunk follows them; a higher source's chunks
// both precede this rank's second chunk and follow its first. Contiguous: a lower source precedes,
// a higher one follows.
struct BlockPart {
  bool skip = false, causal = false;
  int64_t q0 = 0, nq = 0, k0 = 0, nk = 0;
};

int source_of(int rank, int64_t i, int64_t cp) { return static_cast<int>(((rank - i) % cp + cp) % cp); }

BlockPart block_part(int rank, int64_t i, int64_t cp, bool load_balance, int64_t S) {
  const int j = source_of(rank, i, cp);
  if (j == rank) return {false, true, 0, S, 0, S};
  if (load_balance) {
    const int64_t h = S / 2;
    return j < rank ? BlockPart{false, false, 0, S, 0, h} : BlockPart{false, false, h, S - h, 0, S};
  }
  return j < rank ? BlockPart{false, false, 0, S, 0, S} : BlockPart{true};
}

// One block through the fused kernels that return (and back-propagate from) its log-sum-exp.
std::pair<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                bool causal) {
  return nn::attention_block_forward(q, k, v, causal);
}

// The gradients (dq, dk, dv) of one block given the merged output and log-sum-exp of its query rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(const at::Tensor& dout, const at::Tensor& q,
                                                              const at::Tensor& k, const at::Tensor& v,
                                                              const at::Tensor& out, const at::Tensor& lse, bool causal) {
  return nn::attention_block_backward(dout, q, k, v, out, lse, causal);
}

// K and V in one flat buffer (one message per block), and back.
at::Tensor pack(const at::Tensor& k, const at::Tensor& v) {
  return at::cat({k.contiguous().view({-1}), v.contiguous().view({-1})});
}
std::pair<at::Tensor, at::Tensor> unpack(const at::Tensor& flat, at::IntArrayRef shape) {
  const int64_t n = flat.numel() / 2;
  return {flat.narrow(0, 0, n).view(shape), flat.narrow(0, n, n).view(shape)};
}

// Where the K/V blocks come from: all gathered at once, or moved one rank on per block.
class KvSource {
 public:
  KvSource(Group& g, const ContextParallelOptions& o, at::Tensor own)
      : g_(g), ring_(o.rotate == "alltoall"), numel_(own.numel()) {
    if (ring_) {
      current_ = std::move(own);
    } else {
      all_ = at::empty({g.size() * numel_}, own.options());
      g.all_gather(all_, own).wait();
      current_ = own;
    }
  }
  // The buffer of block i's source (blocks in ring order: i = 0 is this rank's own).
  const at::Tensor& block(int64_t i) {
    if (!ring_ && i > 0) current_ = all_.narrow(0, source_of(g_.rank(), i, g_.size()) * numel_, numel_);
    return current_;
  }
  // Posts the move to block i + 1 (ring only; overlaps the work on block i), and completes it.
  void post_next() {
    if (!ring_) return;
    next_ = at::empty_like(current_);
    pending_ = g_.shift(next_, current_, 1);
  }
  void advance() {
    if (!ring_) return;
    pending_.wait();
    current_ = std::move(next_);
  }

 private:
  Group& g_;
  bool ring_;
  int64_t numel_;  // one rank's K/V
  at::Tensor all_, current_, next_;
  Work pending_;
};

struct RingOutput {
  at::Tensor out, lse;
};

RingOutput ring_forward(Group& g, const ContextParallelOptions& o, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v) {
  TraceRange range("context_parallel::ring_attention_forward");
  const int64_t cp = g.size(), S = q.size(2);
  KvSource kv(g, o, pack(k, v));
  at::Tensor out, lse;  // float32 running output and log-sum-exp of the blocks so far
  for (int64_t i = 0; i < cp; ++i) {
    if (i + 1 < cp) kv.post_next();
    const BlockPart p = block_part(g.rank(), i, cp, o.load_balance, S);
    if (!p.skip) {
      auto [kb, vb] = unpack(kv.block(i), k.sizes());
      auto [ob, lb] = block_forward(q.narrow(2, p.q0, p.nq), kb.narrow(2, p.k0, p.nk), vb.narrow(2, p.k0, p.nk), p.causal);
      if (i == 0) {  // the own block covers every query row (each sees at least itself)
        out = ob.to(at::kFloat);
        lse = lb.to(at::kFloat);
      } else {
        at::Tensor o_rows = out.narrow(2, p.q0, p.nq), l_rows = lse.narrow(2, p.q0, p.nq);
        const at::Tensor lb32 = lb.to(at::kFloat), merged = at::logaddexp(l_rows, lb32);
        o_rows.mul_(at::exp(l_rows - merged).unsqueeze(-1));
        o_rows.add_(ob.to(at::kFloat) * at::exp(lb32 - merged).unsqueeze(-1));
        l_rows.copy_(merged);
      }
    }
    if (i + 1 < cp) kv.advance();
  }
  return {out.to(q.scalar_type()), lse};
}

// Gradients of q, k, v (q's dtype) given the output's gradient, the merged output and log-sum-exp.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(Group& g, const ContextParallelOptions& o,
                                                             const at::Tensor& dout, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor& out, const at::Tensor& lse) {
  TraceRange range("context_parallel::ring_attention_backward");
  const int64_t cp = g.size(), S = q.size(2);
  const bool ring = o.rotate == "alltoall";
  KvSource kv(g, o, pack(k, v));
  const at::Tensor lse_in = lse.to(q.is_cuda() ? at::kFloat : lse.scalar_type());
  at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  const int64_t kv_numel = k.numel() + v.numel();
  // Ring: the K/V gradient sum of the block in hand travels with it (received from the previous
  // rank, which held this source's block one step earlier). All-gather: every source's gradient
  // in one buffer, reduce-scattered at the end.
  at::Tensor dkv_all = ring ? at::Tensor() : at::zeros({cp * kv_numel}, q.options().dtype(at::kFloat));
  at::Tensor dkv_in, dkv_out;  // ring: the sum received for the block in hand, the one sent on
  Work dkv_moving;
  for (int64_t i = 0; i < cp; ++i) {
    if (i + 1 < cp) kv.post_next();
    const BlockPart p = block_part(g.rank(), i, cp, o.load_balance, S);
    at::Tensor dkb, dvb;
    if (!p.skip) {
      auto [kb, vb] = unpack(kv.block(i), k.sizes());
      at::Tensor dqb;
      std::tie(dqb, dkb, dvb) =
          block_backward(dout.narrow(2, p.q0, p.nq), q.narrow(2, p.q0, p.nq), kb.narrow(2, p.k0, p.nk),
                         vb.narrow(2, p.k0, p.nk), out.narrow(2, p.q0, p.nq), lse_in.narrow(2, p.q0, p.nq), p.causal);
      dq.narrow(2, p.q0, p.nq).add_(dqb);
    }
    // This source's K/V gradient sum: (ring) the one the previous rank sent, waited for only now
    // that the block is computed, or zeros for the own block; (all-gather) its part of the buffer.
    at::Tensor dkv;
    if (!ring) {
      dkv = dkv_all.narrow(0, source_of(g.rank(), i, cp) * kv_numel, kv_numel);
    } else if (i == 0) {
      dkv = at::zeros({kv_numel}, q.options().dtype(at::kFloat));
    } else {
      dkv_moving.wait();  // the previous block's sum has left; this block's has arrived
      dkv = dkv_in;
    }
    if (!p.skip) {
      auto [dk, dv] = unpack(dkv, k.sizes());
      dk.narrow(2, p.k0, p.nk).add_(dkb);
      dv.narrow(2, p.k0, p.nk).add_(dvb);
    }
    if (ring) {
      dkv_out = dkv;
      dkv_in = at::empty_like(dkv);
      dkv_moving = g.shift(dkv_in, dkv_out, 1);  // on to the next rank; the previous rank's arrives
    }
    if (i + 1 < cp) kv.advance();
  }
  at::Tensor dkv_mine;
  if (ring) {
    dkv_moving.wait();  // after cp blocks: every rank's contribution to this rank's own K/V
    dkv_mine = dkv_in;
  } else {
    dkv_mine = at::empty({kv_numel}, dkv_all.options());
    g.reduce_scatter(dkv_mine, dkv_all).wait();
  }
  auto [dk, dv] = unpack(dkv_mine, k.sizes());
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, ContextParallel* cp) {
    RingOutput r = ring_forward(cp->group(), cp->options(), q, k, v);
    ctx->save_for_backward({q, k, v, r.out, r.lse});
    ctx->saved_data["cp"] = reinterpret_cast<int64_t>(cp);
    return r.out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* cp = reinterpret_cast<ContextParallel*>(ctx->saved_data["cp"].toInt());
    const auto s = ctx->get_saved_variables();
    auto [dq, dk, dv] = ring_backward(cp->group(), cp->options(), grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4]);
    return {dq, dk, dv, at::Tensor()};
  }
};

}  // namespace

ContextParallel::ContextParallel(Group& group, ContextParallelOptions options)
    : group_(group), options_(std::move(options)) {
  TITAN_ASSERT(options_.rotate == "allgather" || options_.rotate == "alltoall", "rotate method ", options_.rotate);
}

int64_t ContextParallel::degree() const { return group_.size(); }
int ContextParallel::rank() const { return group_.rank(); }

at::Tensor ContextParallel::positions(int64_t seq_len) const {
  const int64_t cp = degree(), r = rank();
  if (!options_.load_balance) return at::arange(r * (seq_len / cp), (r + 1) * (seq_len / cp), at::kLong);
  const int64_t c = seq_len / (2 * cp);
  return at::cat({at::arange(r * c, (r + 1) * c, at::kLong), at::arange((2 * cp - 1 - r) * c, (2 * cp - r) * c, at::kLong)});
}

at::Tensor ContextParallel::shard(const at::Tensor& x, int64_t dim) const {
  const int64_t n = x.size(dim), cp = degree(), r = rank();
  check_context_parallel_sequence(n, cp, options_.load_balance, 1, false, "the sequence length");
  if (!options_.load_balance) return x.narrow(dim, r * (n / cp), n / cp).contiguous();
  const int64_t c = n / (2 * cp);
  return at::cat({x.narrow(dim, r * c, c), x.narrow(dim, (2 * cp - 1 - r) * c, c)}, dim);
}

at::Tensor ContextParallel::unshard(const at::Tensor& x, int64_t dim) {
  const int64_t cp = degree(), local = x.size(dim);
  at::Tensor mine = x.movedim(dim, 0).contiguous();
  at::Tensor all = at::empty({cp * mine.numel()}, mine.options());
  group_.all_gather(all, mine).wait();
  std::vector<int64_t> shape = mine.sizes().vec();
  shape[0] = cp * local;
  at::Tensor stacked = all.view(shape);  // rank 0's part, rank 1's part, ...
  at::Tensor out = at::empty_like(stacked);
  for (int64_t r = 0; r < cp; ++r) {
    // Rank r's positions, as positions() gives them for r.
    if (!options_.load_balance) {
      out.narrow(0, r * local, local).copy_(stacked.narrow(0, r * local, local));
    } else {
      const int64_t c = local / 2;
      out.narrow(0, r * c, c).copy_(stacked.narrow(0, r * local, c));
      out.narrow(0, (2 * cp - 1 - r) * c, c).copy_(stacked.narrow(0, r * local + c, c));
    }
  }
  return out.movedim(0, dim);
}

nn::AttentionKernels ContextParallel::attention_kernels() {
  nn::AttentionKernels k;
  k.forward = [this](const at::Tensor& q, const at::Tensor& key, const at::Tensor& v) {
    RingOutput r = ring_forward(group_, options_, q, key, v);
    return std::make_pair(r.out, r.lse);
  };
  k.backward = [this](const at::Tensor& dout, const at::Tensor& q, const at::Tensor& key, const at::Tensor& v,
                      const at::Tensor& out, const at::Tensor& lse) {
    return ring_backward(group_, options_, dout.contiguous(), q, key, v, out, lse);
  };
  return k;
}

at::Tensor ContextParallel::attention(const at::Tensor& q_BHSE, const at::Tensor& k_BKSE, const at::Tensor& v_BKSE) {
  TITAN_ASSERT(q_BHSE.size(2) == k_BKSE.size(2) && k_BKSE.sizes() == v_BKSE.sizes() &&
                   q_BHSE.size(1) % k_BKSE.size(1) == 0,
               "ring attention: q ", q_BHSE.sizes(), ", k ", k_BKSE.sizes(), ", v ", v_BKSE.sizes());
  return RingAttention::apply(q_BHSE, k_BKSE, v_BKSE, this);
}

}  // namespace titan::dist
