#include "titan/distributed/parallel_dims.h"

#include "titan/common/error.h"

namespace titan::dist {

const std::array<std::string, 5>& ParallelDims::dim_names() {
  static const std::array<std::string, 5> names = {"pp", "dp_replicate", "dp_shard", "cp", "tp"};
  return names;
}

ParallelDims::ParallelDims(int64_t dp_replicate, int64_t dp_shard, int64_t cp, int64_t tp, int64_t pp,
                           int64_t world_size, int64_t ep)
    : world_size_(world_size), ep_(ep) {
  TITAN_USER_CHECK(world_size >= 1, "the world size must be at least 1, got ", world_size);
  TITAN_USER_CHECK(dp_replicate >= 1, "parallelism.data_parallel_replicate_degree must be >= 1, got ", dp_replicate);
  TITAN_USER_CHECK(cp >= 1, "parallelism.context_parallel_degree must be >= 1, got ", cp);
  TITAN_USER_CHECK(tp >= 1, "parallelism.tensor_parallel_degree must be >= 1, got ", tp);
  TITAN_USER_CHECK(pp >= 1, "parallelism.pipeline_parallel_degree must be >= 1, got ", pp);
  TITAN_USER_CHECK(dp_shard == -1 || dp_shard >= 1,
                   "parallelism.data_parallel_shard_degree must be -1 (the ranks left over) or >= 1, got ", dp_shard);
  const int64_t others = dp_replicate * cp * tp * pp;
  if (dp_shard == -1) {
    TITAN_USER_CHECK(world_size % others == 0, "the world size ", world_size,
                     " is not divisible by data_parallel_replicate x context x tensor x pipeline degrees = ", others,
                     ": change the degrees or the number of processes");
    dp_shard = world_size / others;
  }
  degrees_ = {pp, dp_replicate, dp_shard, cp, tp};
  TITAN_USER_CHECK(others * dp_shard == world_size, "the parallelism degrees multiply to ", others * dp_shard,
                   " (", describe(), ") but there are ", world_size,
                   " processes: make their product equal the world size, or set "
                   "parallelism.data_parallel_shard_degree = -1 to use the rest");
  TITAN_USER_CHECK(ep >= 1, "parallelism.expert_parallel_degree must be >= 1, got ", ep);
  TITAN_USER_CHECK((dp_shard * cp) % ep == 0, "parallelism.expert_parallel_degree ", ep,
                   " does not divide data_parallel_shard_degree x context_parallel_degree = ", dp_shard, " x ", cp,
                   " = ", dp_shard * cp, ": expert parallelism borrows its ranks from the FSDP ranks (dp_shard x cp); "
                   "choose a degree that divides ", dp_shard * cp);
}

std::vector<int> ParallelDims::members(const std::string& name) const {
  if (name == "dp") return {1, 2};
  if (name == "dp_shard_cp") return {2, 3};
  if (name == "dp_cp") return {1, 2, 3};
  if (name == "world") return {0, 1, 2, 3, 4};
  for (int d = 0; d < 5; ++d)
    if (dim_names()[d] == name) return {d};
  TITAN_ASSERT(false, "unknown mesh dimension '", name, "'");
  return {};
}

int64_t ParallelDims::degree(const std::string& name) const {
  if (name == "ep") return ep_;
  if (name == "efsdp") return degree("dp_shard_cp") / ep_;
  int64_t n = 1;
  for (int d : members(name)) n *= degrees_[d];
  return n;
}

std::vector<int> ParallelDims::group_ranks(const std::string& name, int rank) const {
  TITAN_ASSERT(rank >= 0 && rank < world_size_, "rank ", rank, " outside the world");
  if (name == "ep" || name == "efsdp") {
    // dp_shard_cp's members j = f * ep + e: ep groups share f, efsdp groups share e.
    const std::vector<int> shard_cp = group_ranks("dp_shard_cp", rank);
    const int64_t j = rank_in("dp_shard_cp", rank);
    std::vector<int> out;
    for (int64_t i = 0; i < static_cast<int64_t>(shard_cp.size()); ++i)
      if (name == "ep" ? i / ep_ == j / ep_ : i % ep_ == j % ep_) out.push_back(shard_cp[static_cast<size_t>(i)]);
    return out;
  }
  // Coordinates of `rank`, then enumerate the spanned dimensions (row-major among them).
  std::array<int64_t, 5> coord;
  int64_t r = rank;
  for (int d = 4; d >= 0; --d) {
    coord[d] = r % degrees_[d];
    r /= degrees_[d];
  }
  const std::vector<int> dims = members(name);
  std::vector<int> ranks;
  const int64_t n = degree(name);
  for (int64_t i = 0; i < n; ++i) {
    auto c = coord;
    int64_t rest = i;
    for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
      c[*it] = rest % degrees_[*it];
      rest /= degrees_[*it];
    }
    int64_t g = 0;
    for (int d = 0; d < 5; ++d) g = g * degrees_[d] + c[d];
    ranks.push_back(static_cast<int>(g));
  }
  return ranks;
}

int ParallelDims::rank_in(const std::string& name, int rank) const {
  const auto ranks = group_ranks(name, rank);
  for (size_t i = 0; i < ranks.size(); ++i)
    if (ranks[i] == rank) return static_cast<int>(i);
  TITAN_ASSERT(false, "rank not in its own group");
  return -1;
}

std::string ParallelDims::describe() const {
  return "dp_replicate " + std::to_string(dp_replicate()) + ", dp_shard " + std::to_string(dp_shard()) + ", cp " +
         std::to_string(cp()) + ", tp " + std::to_string(tp()) + ", pp " + std::to_string(pp()) +
         (ep_ > 1 ? ", ep " + std::to_string(ep_) : "");
}

}  // namespace titan::dist
