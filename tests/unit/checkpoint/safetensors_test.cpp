#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>

namespace titan {
namespace {

TEST(Safetensors, RoundTripKeepsDtypesShapesValuesAndMetadata) {
  test::TempDir dir;
  safetensors::Tensors in = {
      {"a.f32", at::randn({3, 5})},
      {"b.bf16", at::randn({7}).to(at::kBFloat16)},
      {"c.i64", at::arange(12, at::kLong).view({2, 2, 3})},
      {"d.scalar", at::scalar_tensor(2.5, at::kDouble)},
      {"e.noncontiguous", at::randn({4, 6}).t()},
  };
  safetensors::save(dir / "x.safetensors", in, {{"config", "{\"dim\": 4}"}});
  auto file = safetensors::load(dir / "x.safetensors");
  ASSERT_EQ(file.tensors.size(), in.size());
  for (const auto& [name, t] : in) {
    ASSERT_TRUE(file.tensors.count(name)) << name;
    EXPECT_EQ(file.tensors[name].scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(at::equal(file.tensors[name], t.contiguous())) << name;
  }
  EXPECT_EQ(file.metadata.at("config"), "{\"dim\": 4}");
}

TEST(Safetensors, PythonReaderAgrees) {
  // The file titan writes is read by the safetensors package itself, values included.
  test::TempDir dir;
  safetensors::save(dir / "x.safetensors", {{"w", at::arange(6, at::kFloat).view({2, 3})}});
  auto r = test::run_process({test::python(), "-c",
                              "import sys; from safetensors.torch import load_file; t = load_file(sys.argv[1])['w'];"
                              "assert t.shape == (2, 3) and t.sum().item() == 15.0, t; print('ok')",
                              dir / "x.safetensors"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(Safetensors, BadFilesGiveClearErrors) {
  test::TempDir dir;
  EXPECT_THROW(safetensors::load(dir / "missing.safetensors"), UserError);
  safetensors::save(dir / "ok.safetensors", {{"w", at::ones({64})}});
  // Truncate: header intact, data cut short.
  std::ifstream in(dir / "ok.safetensors", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  std::ofstream(dir / "short.safetensors", std::ios::binary) << bytes.substr(0, bytes.size() - 16);
  try {
    safetensors::load(dir / "short.safetensors");
    FAIL() << "a truncated file loaded";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
  std::ofstream(dir / "garbage.safetensors", std::ios::binary) << "not a safetensors file at all";
  EXPECT_THROW(safetensors::load(dir / "garbage.safetensors"), UserError);
}

}  // namespace
}  // namespace titan
