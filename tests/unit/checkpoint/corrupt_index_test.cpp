// Damaged checkpoint folders found by fuzzing (tests/fuzz/regressions/checkpoint/): the reader rejects
// them with a UserError naming the file when it opens them, before any read.
#include "fuzz_regressions.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/file_io.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace titan::checkpoint {
namespace {

std::string open_error(const std::string& dir) {
  try {
    Reader reader(dir);
  } catch (const UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "the checkpoint in " << dir << " opened";
  return "";
}

TEST(CheckpointCorruptIndex, AFileEntryWithoutItsSizeIsACorruptIndex) {
  test::TempDir dir;
  const auto files = test::fuzz_regression_files("checkpoint", "index_file_without_bytes");
  test::write_bytes(dir / "index.json", files.at(0));
  const std::string e = open_error(dir.path());
  EXPECT_NE(e.find("index.json is corrupt"), std::string::npos) << e;
  EXPECT_NE(e.find("'bytes'"), std::string::npos) << e;
}

TEST(CheckpointCorruptIndex, ASliceOutsideItsTensorIsCaughtWhenOpening) {
  test::TempDir dir;
  const auto files = test::fuzz_regression_files("checkpoint", "slice_outside_shape");
  test::write_bytes(dir / "index.json", files.at(0));
  const std::string e = open_error(dir.path());
  EXPECT_NE(e.find("a slice of tensor 'model.w'"), std::string::npos) << e;
  EXPECT_NE(e.find("lies outside its shape [4, 3]"), std::string::npos) << e;
}

int open_fds() {
  int n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd"); it != std::filesystem::directory_iterator(); ++it) ++n;
  return n;
}

TEST(CheckpointCorruptIndex, ASafetensorsShapeLargerThanItsBytesIsCaughtBeforeAllocating) {
  test::TempDir dir;
  const auto files = test::fuzz_regression_files("checkpoint", "safetensors_huge_shape");
  test::write_bytes(dir / "rank-00000.safetensors", files.at(1));
  const int fds = open_fds();
  try {
    SafetensorsFile f(dir / "rank-00000.safetensors");
    FAIL() << "a header whose shape needs more bytes than its offsets give was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("shape"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("the file is corrupt"), std::string::npos) << e.what();
  }
  EXPECT_EQ(open_fds(), fds) << "the rejected file was left open";
}

}  // namespace
}  // namespace titan::checkpoint
