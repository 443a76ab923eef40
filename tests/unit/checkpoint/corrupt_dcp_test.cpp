// Damaged torch.distributed.checkpoint folders found by fuzzing (tests/fuzz/regressions/dcp/): each is
// a clear UserError naming the file and the value (without one, test::error_of's empty message fails
// the checks), with nothing read outside the bytes the folder holds.
#include "fuzz_regressions.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/dcp.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace titan::checkpoint {
namespace {

// The regression's step folder: `.metadata`, then `__0_0.distcp`, as the dcp fuzz target writes them.
std::string write_folder(const test::TempDir& dir, const std::string& name) {
  const auto files = test::fuzz_regression_files("dcp", name);
  const std::string step = dir / "step-1";
  std::filesystem::create_directories(step);
  test::write_bytes(step + "/.metadata", files.at(0));
  test::write_bytes(step + "/__0_0.distcp", files.at(1));
  return step;
}

// The error of reading the regression folder's state for a data-parallel degree.
std::string state_error(const std::string& name, int64_t dp_degree) {
  test::TempDir dir;
  DcpSource source(write_folder(dir, name));
  return test::error_of([&] { (void)source.state(dp_degree); });
}

// A torch.save blob whose zip directory points past the blob: read through a reader bounded to it,
// the archive is refused (LibTorch's own in-memory reader copied whatever lay after the blob). Here
// the message is checked; the read past the blob is seen by the fuzz target's replay of the same input
// under AddressSanitizer (scripts/fuzz.sh), as a plain build reads it unnoticed.
TEST(DcpCorrupt, AZipDirectoryBeyondTheBlobIsADamagedValue) {
  const std::string e = state_error("zip_directory_beyond_the_blob", 1);
  EXPECT_NE(e.find("__0_0.distcp is not readable"), std::string::npos) << e;
  EXPECT_NE(e.find("the value of 'train_state."), std::string::npos) << e;
  EXPECT_NE(e.find("zip archive"), std::string::npos) << e;
}

// A chunk whose pickled tensor has a storage offset past its 24-byte storage: refused when loaded,
// before any copy reads it.
TEST(DcpCorrupt, ATensorViewPastItsStorageIsADamagedChunk) {
  test::TempDir dir;
  DcpSource source(write_folder(dir, "tensor_view_past_its_storage"));
  const auto meta = source.meta("model.layers.0.attention.wq.weight");
  ASSERT_TRUE(meta.has_value());
  const std::string e = test::error_of([&] {
    (void)source.read("model.layers.0.attention.wq.weight", std::vector<int64_t>(meta->shape.size(), 0), meta->shape);
  });
  EXPECT_NE(e.find("__0_0.distcp is damaged at byte"), std::string::npos) << e;
  EXPECT_NE(e.find("'layers.0.attention.wq.weight', a chunk at offsets [0, 0]"), std::string::npos) << e;
  EXPECT_NE(e.find("a tensor of size [2, 3], strides [3, 1] and storage offset 32 reaches past its storage of 24 bytes"),
            std::string::npos) << e;
}

// A value whose pickle names torch._tensor._rebuild_from_type_v2: LibTorch then reads a later global
// as another one (a storage type other than the one titan checked). Only a plain tensor's globals are
// read.
TEST(DcpCorrupt, AGlobalOutsideAPlainTensorsPickleIsADamagedValue) {
  const std::string e = state_error("global_read_as_another", 1);
  EXPECT_NE(e.find("the value of 'train_state.step' in __0_0.distcp is not readable: its pickle names "
                   "torch._tensor._rebuild_from_type_v2, which titan does not read"),
            std::string::npos) << e;
}

// A token count that the data-parallel degree multiplies past 64 bits.
TEST(DcpCorrupt, ATokenCountOverflowingWithTheDegreeIsAnError) {
  const std::string e = state_error("ntokens_seen_times_dp_overflows", 2);
  EXPECT_NE(e.find("'train_state.ntokens_seen' (4611686018427387904) times the data-parallel degree 2 does not fit 64 "
                   "bits"),
            std::string::npos) << e;
}

// Blobs LibTorch's reader takes as they are (tests/reference/damaged_dcp_blobs.py writes them with
// PyTorch): a storage reference asking for more elements than its record holds, and a value that is a
// list holding itself.
TEST(DcpCorrupt, AStorageLargerThanItsRecordAndASelfContainingValueAreDamagedValues) {
  test::TempDir dir;
  const std::string folder = dir / "step-1";
  const test::ProcessResult r = test::run_process(
      {test::python(), std::string(TITAN_SOURCE_DIR) + "/tests/reference/damaged_dcp_blobs.py", folder});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  DcpSource source(folder);
  std::string e = test::error_of([&] { (void)source.read("model.norm.weight", {0}, {16}); });
  EXPECT_NE(e.find("__0_0.distcp is damaged at byte 0 ('norm.weight', a chunk at offsets [0])"), std::string::npos) << e;
  EXPECT_NE(e.find("a storage of 16 elements of 4 bytes in data/0, which holds 24 bytes"), std::string::npos) << e;
  e = test::error_of([&] { (void)source.state(1); });
  EXPECT_NE(e.find("the value of 'train_state.step' in __0_0.distcp is not readable: its pickle makes a value that "
                   "holds itself"),
            std::string::npos) << e;
}

}  // namespace
}  // namespace titan::checkpoint
