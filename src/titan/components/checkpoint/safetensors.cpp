#include "titan/components/checkpoint/safetensors.h"

#include "titan/common/error.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
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

void save(const std::string& path, const Tensors& tensors, const Metadata& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> blobs;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    at::Tensor cpu = t.detach().to(at::kCPU).contiguous();
    const uint64_t nbytes = cpu.numel() * cpu.element_size();
    header[name] = {{"dtype", dtype_name(cpu.scalar_type())},
                    {"shape", cpu.sizes().vec()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    blobs.push_back(cpu);
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // align the data section to 8 bytes
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TITAN_USER_CHECK(out.good(), "cannot open ", tmp, " for writing: check that the folder exists and is writable");
    const uint64_t header_len = json.size();
    out.write(reinterpret_cast<const char*>(&header_len), 8);
    out.write(json.data(), static_cast<std::streamsize>(json.size()));
    for (const auto& b : blobs)
      out.write(static_cast<const char*>(b.data_ptr()), static_cast<std::streamsize>(b.numel() * b.element_size()));
    out.flush();
    TITAN_USER_CHECK(out.good(), "writing ", tmp, " failed (disk full?)");
  }
  TITAN_USER_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename ", tmp, " to ", path);
}

File load(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  TITAN_USER_CHECK(in.good(), "cannot open safetensors file ", path, ": no such file or not readable");
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  uint64_t header_len = 0;
  TITAN_USER_CHECK(file_size >= 8 && in.read(reinterpret_cast<char*>(&header_len), 8),
                   path, " is not a safetensors file: shorter than its 8-byte header length");
  TITAN_USER_CHECK(header_len <= file_size - 8, path, " is truncated or not a safetensors file: header length ",
                   header_len, " exceeds the file size ", file_size);
  std::string json(header_len, '\0');
  in.read(json.data(), static_cast<std::streamsize>(header_len));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(json);
  } catch (const std::exception& e) {
    throw UserError(path + ": malformed safetensors header: " + e.what());
  }
  TITAN_USER_CHECK(header.is_object(), path, ": malformed safetensors header: not a JSON object");
  const uint64_t data_size = file_size - 8 - header_len;
  File file;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      for (const auto& [k, v] : entry.items())
        file.metadata[k] = v.is_string() ? v.get<std::string>() : v.dump();
      continue;
    }
    try {
      const std::string dtype = entry.at("dtype").get<std::string>();
      const std::vector<int64_t> shape = entry.at("shape").get<std::vector<int64_t>>();
      const auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      at::ScalarType type = at::ScalarType::Undefined;
      for (const auto& [n, t] : dtypes())
        if (n == dtype) type = t;
      TITAN_USER_CHECK(type != at::ScalarType::Undefined, path, ": tensor '", name, "' has unsupported dtype ", dtype);
      TITAN_USER_CHECK(offsets.size() == 2 && offsets[0] <= offsets[1] && offsets[1] <= data_size, path,
                       ": tensor '", name, "' has data offsets outside the file (truncated file?)");
      at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
      const uint64_t nbytes = t.numel() * t.element_size();
      TITAN_USER_CHECK(offsets[1] - offsets[0] == nbytes, path, ": tensor '", name, "' holds ",
                       offsets[1] - offsets[0], " bytes but its dtype and shape need ", nbytes);
      in.seekg(static_cast<std::streamoff>(8 + header_len + offsets[0]));
      in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(nbytes));
      TITAN_USER_CHECK(in.good(), path, ": reading tensor '", name, "' failed");
      file.tensors.emplace(name, t);
    } catch (const nlohmann::json::exception& e) {
      throw UserError(path + ": malformed header entry for '" + name + "': " + e.what());
    }
  }
  return file;
}

}  // namespace titan::safetensors
