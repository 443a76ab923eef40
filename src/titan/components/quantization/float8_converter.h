// model.converters (torchtitan's model converters), applied to a built model before it is
// parallelized: "quantize.linear.float8" (older name "float8") turns Linear layers into float8
// ones under [quantize.linear.float8]'s recipe (nn/float8.h, docs/float8.md);
// "quantize.grouped_mm.float8" runs the grouped matmuls of the MoE experts named in
// [quantize.grouped_mm.float8] fqns in float8 (rowwise). MX formats and any other name are refused.
#pragma once

#include "titan/config/job_config.h"
#include "titan/models/model.h"
#include "titan/nn/float8.h"

#include <memory>
#include <string>
#include <vector>

namespace titan {

struct Float8Conversion {
  std::shared_ptr<const nn::Float8Recipe> recipe;  // null: no float8 converter
  std::vector<std::string> converted;              // Linear layers now float8, by name
  std::vector<std::string> skipped;                // "name (why)": filter_fqns, or dims not multiples of 16
  // "quantize.grouped_mm.float8": the MoE experts' recipe (null: no such converter), which experts
  // (name substrings, quantize.grouped_mm.float8.fqns) and those converted.
  std::shared_ptr<const nn::Float8Recipe> grouped_recipe;
  std::vector<std::string> grouped_fqns, grouped_converted;
};

// The run's float8 recipe from model.converters and [quantize.linear.float8] (null recipe without
// the float8 converter). Throws UserError for an unknown converter, an MX one, an unknown recipe,
// or an option titan cannot honour with the layout (named, with what to do).
Float8Conversion float8_conversion(const JobConfig& cfg, int64_t tensor_parallel_degree);

// Converts `model`'s Linear layers (the whole model, or one pipeline stage): every one but those
// whose name contains an entry of filter_fqns or whose in or out features are not multiples of 16
// (the float8 kernels' rule). Records the converted and skipped names in `c` when `record`. With
// `require_some`, throws UserError when the converter is on and no layer could be converted.
void convert_to_float8(LanguageModelImpl& model, Float8Conversion& c, const config::Float8Linear& options,
                       bool record = true, bool require_some = true);

// One line for the log: recipe, layers converted, layers kept in high precision.
std::string describe(const Float8Conversion& c);

// model.print_after_conversion: one line per module, indented by depth, with its class, its own
// parameters' shapes and, for a float8 Linear, its recipe.
std::string model_description(const LanguageModelImpl& model);

}  // namespace titan
