// Stand-in for the ranks of a save in one process: the ranks' write() calls run one after another,
// rank 0 last. Rank r's gather hands its record to a shared list, and rank 0 gets all of them; the
// other ranks see rank 0's outcome as a success (they return before rank 0 has written the index).
#pragma once

#include "titan/components/checkpoint/checkpoint.h"

#include <string>
#include <vector>

namespace titan::checkpoint {

class FakeRanks : public Coordinator {
 public:
  FakeRanks(int rank, int world, std::vector<std::string>* all) : rank_(rank), world_(world), all_(all) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::vector<std::string> gather(const std::string& record) override {
    (*all_)[static_cast<size_t>(rank_)] = record;
    return rank_ == 0 ? *all_ : std::vector<std::string>{};
  }
  std::string broadcast(const std::string& message) override { return rank_ == 0 ? message : ""; }

 private:
  int rank_, world_;
  std::vector<std::string>* all_;
};

}  // namespace titan::checkpoint
