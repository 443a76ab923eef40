// ParallelDims: the parallelism degrees of a run, validated, and the rank layout they imply.
//
// Ranks are laid out row-major over the named dimensions in torchtitan's order
//   pp, dp_replicate, dp_shard, cp, tp          (tp varies fastest)
// so rank = (((pp * R + dr) * S + ds) * C + cp) * T + tp. Flattened dimensions used by the
// parallelisms: "dp" = dp_replicate x dp_shard (the data-parallel ranks: batch split, loss average),
// "dp_shard_cp" = dp_shard x cp (the ranks FSDP shards over).
//
// Expert parallelism borrows its ranks from dp_shard x cp (torchtitan's sparse mesh): the dp_shard_cp
// group, in its order, is split row-major into efsdp x ep (ep varies fastest, so an ep group is
// ep consecutive members of dp_shard_cp). "ep": the ranks that exchange routed tokens, each holding
// E / ep experts; "efsdp": the ranks holding the same experts, over which FSDP shards them.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace titan::dist {

class ParallelDims {
 public:
  // dp_shard = -1 means "the ranks the other degrees leave". Throws UserError when the degrees are
  // invalid or their product is not world_size, saying which option to change.
  // ep: the expert-parallel degree, which must divide dp_shard x cp.
  ParallelDims(int64_t dp_replicate, int64_t dp_shard, int64_t cp, int64_t tp, int64_t pp, int64_t world_size,
               int64_t ep = 1);

  int64_t dp_replicate() const { return degrees_[1]; }
  int64_t dp_shard() const { return degrees_[2]; }
  int64_t cp() const { return degrees_[3]; }
  int64_t tp() const { return degrees_[4]; }
  int64_t pp() const { return degrees_[0]; }
  int64_t ep() const { return ep_; }
  int64_t world_size() const { return world_size_; }
  int64_t dp_size() const { return dp_replicate() * dp_shard(); }
  int64_t non_data_parallel_size() const { return cp() * tp() * pp(); }

  bool dp_enabled() const { return dp_size() > 1; }
  bool dp_replicate_enabled() const { return dp_replicate() > 1; }
  bool fsdp_enabled() const { return dp_shard() * cp() > 1; }  // FSDP or HSDP
  bool ddp_enabled() const { return dp_replicate() > 1 && dp_shard() * cp() == 1; }

  // Names of the basic dimensions in layout order, and of a dimension's degree.
  static const std::array<std::string, 5>& dim_names();
  int64_t degree(const std::string& name) const;  // basic, flattened ("dp", "dp_shard_cp", "world"), "ep", "efsdp"

  // The global ranks of the group along `name` (basic or flattened) that contains `rank`, in order,
  // and `rank`'s index in it.
  std::vector<int> group_ranks(const std::string& name, int rank) const;
  int rank_in(const std::string& name, int rank) const;

  std::string describe() const;  // "dp_replicate 1, dp_shard 4, cp 1, tp 1, pp 1" (and ", ep 2" with EP)

 private:
  std::vector<int> members(const std::string& name) const;  // basic dimensions a name spans
  std::array<int64_t, 5> degrees_;  // pp, dp_replicate, dp_shard, cp, tp
  int64_t world_size_;
  int64_t ep_ = 1;
};

}  // namespace titan::dist
