// Test entry point: runs the GoogleTest suite, or, when TITAN_TEST_WORKER names a registered worker,
// that worker alone (multi-process tests start this binary again as their workers).
#include "test_util.h"

#include "titan/tools/estimate.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <exception>

int main(int argc, char** argv) {
  titan::set_memory_budget_planner(titan::memory_budget_plan);  // as titan's main does
  if (const char* worker = std::getenv("TITAN_TEST_WORKER")) {
    auto it = titan::test::workers().find(worker);
    if (it == titan::test::workers().end()) {
      std::fprintf(stderr, "unknown test worker '%s'\n", worker);
      return 2;
    }
    try {
      return it->second();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "worker %s failed: %s\n", worker, e.what());
      return 1;
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
