// Reading and writing the safetensors format (Hugging Face): an 8-byte little-endian header length,
// a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the
// raw little-endian tensor bytes.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace titan::safetensors {

using Tensors = std::map<std::string, at::Tensor>;
using Metadata = std::map<std::string, std::string>;

// safetensors' dtype names ("F32", "BF16", ...) and back; UserError for dtypes it cannot hold.
std::string dtype_name(at::ScalarType t);
at::ScalarType dtype_from_name(const std::string& name);

// Writes CPU copies of `tensors` (any device; made contiguous) atomically: to path + ".tmp", fsynced,
// then renamed. Throws titan::UserError naming the path when the file cannot be written.
void save(const std::string& path, const Tensors& tensors, const Metadata& metadata = {});

struct File {
  Tensors tensors;  // CPU tensors owning their memory
  Metadata metadata;
};
// Reads a whole file. Throws titan::UserError naming the path and the defect when the file is
// missing, truncated, or its header is malformed (unknown dtype, offsets out of range, sizes that disagree).
File load(const std::string& path);

}  // namespace titan::safetensors
