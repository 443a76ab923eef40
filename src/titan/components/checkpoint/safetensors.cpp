#include "titan/components/checkpoint/safetensors.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/file_io.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <vector>

namespace titan::safetensors {
namespace {

const std::vector<std::pair<std::string, at::ScalarType>>& dtypes() {
  static const std::vector<std::pair<std::string, at::ScalarType>> table = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}, {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2},
  };
  return table;
}

}  // namespace

std::string dtype_name(at::ScalarType t) {
  for (const auto& [name, type] : dtypes())
    if (type == t) return name;
  throw UserError(std::string("safetensors cannot store dtype ") + c10::toString(t));
}

at::ScalarType dtype_from_name(const std::string& name) {
  for (const auto& [n, t] : dtypes())
    if (n == name) return t;
  throw UserError("unsupported safetensors dtype '" + name + "'");
}

// Whole files through the checkpoint reader and writer (one header parser, one durable writer).
void save(const std::string& path, const Tensors& tensors, const Metadata& metadata) {
  std::vector<checkpoint::SafetensorsEntry> entries;
  for (const auto& [name, t] : tensors) entries.push_back({name, t.detach().to(at::kCPU).contiguous()});
  checkpoint::write_safetensors(path, entries, metadata);
}

File load(const std::string& path) {
  checkpoint::SafetensorsFile f(path);
  File file;
  file.metadata = f.metadata();
  for (const auto& [name, meta] : f.tensors()) file.tensors.emplace(name, f.read(name));
  return file;
}

}  // namespace titan::safetensors
