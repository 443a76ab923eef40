// Where a tensor lives: the one public description of a rank's piece of a global tensor.
//
// Every parameter and optimizer-state tensor a rank holds is a PlacedTensor: its local tensor plus a
// Placement saying which part of which global tensor it is. Each parallelism sets the placements of
// what it shards (FSDP: dim 0 over "dp_shard_cp", replicated over "dp_replicate"; DDP: replicated over
// "dp_replicate"; TP: dim 0 or 1 over "tp", norms replicated over "tp"); checkpoints, gradient-norm clipping and gathering full weights read only placements.
//
// A shard along a mesh dimension splits one tensor dimension into `group size` chunks of
// `local_size` entries (torch.chunk's rule: ceil(size / n)); the chunk of group rank k starts at
// `offset` = k * local_size and holds `length` = min(local_size, size - offset) real entries, the
// rest is padding (zeros). Shards are listed in the order they were applied; a later shard splits
// the result of the earlier ones, and its offset is relative to that result.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace titan::dist {

class Mesh;

struct Shard {
  std::string mesh_dim;    // the mesh group that splits it ("dp_shard_cp", later "tp", ...)
  int64_t tensor_dim = 0;  // which dimension of the tensor is split
  int64_t offset = 0;      // where this rank's chunk starts in that dimension
  int64_t length = 0;      // real entries of the chunk (padding excluded)
  int64_t local_size = 0;  // entries of the chunk including padding (the local tensor's size)
};

struct Placement {
  std::vector<int64_t> global_shape;
  std::vector<Shard> shards;              // empty: the whole tensor
  std::vector<std::string> replicated;    // mesh groups holding identical copies (HSDP/DDP replicas)
  bool primary = true;  // this rank's copy is the one written when copies are identical

  // The part of the global tensor this rank holds: per dimension the first index and the count.
  // For a rank that holds only padding along some dimension the count is 0.
  std::vector<int64_t> global_begin() const;
  std::vector<int64_t> global_length() const;
  // The real (non-padding) region of a local tensor of this placement.
  at::Tensor real_part(const at::Tensor& local) const;
  int64_t real_numel() const;
};

struct PlacedTensor {
  std::string name;  // global name ("layers.0.attention.wq.weight")
  at::Tensor local;
  Placement placement;
};

// A placement of the whole tensor `t` on every rank, replicated over `replicated` (this rank primary
// when `primary`).
Placement whole(const at::Tensor& t, std::vector<std::string> replicated = {}, bool primary = true);

// The placement of a piece `inner` describes, of a local tensor that `outer` describes: TP's shard
// sharded again by FSDP. Shards are concatenated (outer's first), replica groups joined, and the
// piece is primary when it is in both.
Placement compose(const Placement& outer, const Placement& inner);

// The chunk of `size` entries that rank `rank` of `n` holds (torch.chunk's rule, padded).
Shard chunk(const std::string& mesh_dim, int64_t tensor_dim, int64_t size, int rank, int n);

// Replaces `param` by its chunk `rank` of `n` along `dim` (whose size n must divide) and returns the
// chunk's placement: a Shard over `mesh_dim` (tensor and expert parallelism). A parameter built
// without memory gets the chunk's shape only.
Placement shard_in_place(at::Tensor& param, int64_t dim, const std::string& mesh_dim, int rank, int n);

// The L2 norm of the gradients of `params` as one global tensor set, with the local sums of squares
// added over every mesh dimension a gradient is sharded on. Collective over those groups.
double global_grad_norm(const std::vector<PlacedTensor>& params, Mesh& mesh);

// Gradient clipping like torch.nn.utils.clip_grad_norm_ (coefficient max_norm / (norm + 1e-6),
// clamped to 1) with the global norm above, the gradients left as they are: returns {norm, divisor}.
// The norm before clipping: a scalar tensor on the mesh's device (read it when needed), equal on
// every rank. The divisor (clip_divisor: 1 / coefficient, an fp32 scalar on the norm's device;
// undefined when max_norm <= 0, which only measures) is for the optimizer to divide each gradient by
// as it reads it (Optimizer::step), which saves a pass over every gradient.
// poison (a scalar, 0 or +inf) is added to every partial sum before it is reduced, so that a value
// one rank found bad (a non-finite loss) makes the norm infinite on every rank that rank's gradient
// sums reach, with no extra collective.
// sum_over: groups whose members hold different parameters altogether (pipeline stages, "pp"): the
// total is summed over them too.
std::pair<at::Tensor, at::Tensor> grad_norm_and_clip_divisor(const std::vector<PlacedTensor>& params, double max_norm,
                                                             Mesh& mesh, const at::Tensor& poison = {},
                                                             const std::vector<std::string>& sum_over = {});

// The norm grad_norm_and_clip_divisor measures, from each parameter's gradient norm taken earlier (norms[i] for
// params[i]: fp64 0-dim, as at::_foreach_norm gives it; undefined where it had no gradient), for
// gradients the optimizer has already consumed (optimizer.early_step_in_backward). Equal to the
// norm of the gradients themselves bit for bit.
at::Tensor grad_norm_of(const std::vector<PlacedTensor>& params, const std::vector<at::Tensor>& norms, Mesh& mesh,
                        const at::Tensor& poison = {}, const std::vector<std::string>& sum_over = {});

// The full tensor of `t` (unpadded, global shape), all-gathered over its shard groups; collective
// over those groups (every rank holding a piece must call it in the same order).
at::Tensor gather_full(const PlacedTensor& t, Mesh& mesh);

}  // namespace titan::dist
