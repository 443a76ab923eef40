#include "titan/components/quantization/float8_converter.h"

#include "titan/common/error.h"
#include "titan/config/legacy.h"
#include "titan/nn/layers.h"
#include "titan/nn/moe.h"

#include <algorithm>
#include <sstream>

namespace titan {

namespace {

// An entry of filter_fqns that is not a name: skip layers too small for float8 to pay off.
constexpr const char* kAutoFilter = "auto_filter_small_kn";

// torchao's size rule for the recipe (N out features, K in features), from its H100 measurements.
bool too_small_for_float8(const std::string& recipe, int64_t N, int64_t K) {
  if (recipe == "tensorwise") return K <= 4096 && N <= 1024;
  return N <= 2048 || K <= 1024 || (N <= 4096 && K <= 2048);  // rowwise
}

// "a, b, c and 12 more": the first `shown` entries of a list that may hold one per layer.
std::string first_of(const std::vector<std::string>& names, size_t shown = 8) {
  std::string s;
  for (size_t i = 0; i < std::min(shown, names.size()); ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > shown) s += " and " + std::to_string(names.size() - shown) + " more";
  return s;
}

}  // namespace

Float8Conversion float8_conversion(const JobConfig& cfg, int64_t tensor_parallel_degree) {
  Float8Conversion c;
  bool float8 = false, grouped = false;
  for (const std::string& name : cfg.model.converters) {
    if (name == config::kFloat8Converter || name == "float8") {
      float8 = true;
      continue;
    }
    if (name == config::kFloat8GroupedConverter) {
      grouped = true;
      continue;
    }
    TITAN_USER_CHECK(name.find("mx") == std::string::npos,
                     "model.converters \"", name, "\": MX formats (MXFP8, MXFP4) are not supported; they need "
                     "Blackwell GPUs' block-scaled matmuls. Use \"", config::kFloat8Converter, "\" (float8 with "
                     "[quantize.linear.float8]) or remove the converter");
    throw UserError("model.converters \"" + name + "\" is not a model converter; titan has \"" +
                    config::kFloat8Converter + "\" (float8 linear layers, set with [quantize.linear.float8]) and \"" +
                    config::kFloat8GroupedConverter + "\" (float8 MoE experts, [quantize.grouped_mm.float8])");
  }
  if (grouped) {
    // torchao's MoE training recipe: rowwise e4m3 with power-of-2 scales for all three products.
    // quantize.linear.float8.emulate (titan's extension) emulates these products as well.
    c.grouped_recipe = std::make_shared<const nn::Float8Recipe>(nn::Float8Recipe::named("rowwise", cfg.float8.emulate));
    c.grouped_fqns = cfg.float8_grouped.fqns;
    c.grouped_fqns.erase(std::remove(c.grouped_fqns.begin(), c.grouped_fqns.end(), std::string()), c.grouped_fqns.end());
    TITAN_USER_CHECK(!c.grouped_fqns.empty(), "model.converters \"", config::kFloat8GroupedConverter,
                     "\" converts the MoE modules named in quantize.grouped_mm.float8.fqns, which is empty: set it, "
                     "e.g. fqns = [\"experts\"] (--quantize.grouped_mm.float8.fqns experts)");
  }
  const config::Float8Linear& o = cfg.float8;
  if (!float8) return c;
  c.recipe = std::make_shared<const nn::Float8Recipe>(nn::Float8Recipe::named(o.recipe_name, o.emulate));
  TITAN_USER_CHECK(c.recipe->name != "rowwise_with_gw_hp" ||
                       std::find(o.filter_fqns.begin(), o.filter_fqns.end(), kAutoFilter) == o.filter_fqns.end(),
                   "quantize.linear.float8.filter_fqns \"", kAutoFilter, "\" has size rules for the tensorwise and "
                   "rowwise recipes only, not rowwise_with_gw_hp: list the layers to keep in high precision by name");
  TITAN_USER_CHECK(!o.enable_fsdp_float8_all_gather || c.recipe->name == "tensorwise",
                   "quantize.linear.float8.enable_fsdp_float8_all_gather needs the tensorwise recipe (one scale per "
                   "weight, cast before the all-gather); recipe_name \"", c.recipe->name, "\" scales rows. Set "
                   "recipe_name = \"tensorwise\" or enable_fsdp_float8_all_gather = false");
  TITAN_USER_CHECK(!o.precompute_float8_dynamic_scale_for_fsdp || o.enable_fsdp_float8_all_gather,
                   "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp computes the scales of the FSDP "
                   "float8 all-gather: set enable_fsdp_float8_all_gather = true as well, or set it to false");
  TITAN_USER_CHECK(tensor_parallel_degree == 1 || !cfg.parallelism.enable_async_tensor_parallel,
                   "float8 linear layers (model.converters \"", config::kFloat8Converter,
                   "\") with parallelism.enable_async_tensor_parallel are not supported yet: async TP's decomposed "
                   "all-gather and reduce-scatter multiply in high precision. Turn async TP off "
                   "(--parallelism.enable_async_tensor_parallel false) or drop the converter");
  return c;
}

namespace {

// The "quantize.grouped_mm.float8" converter: MoE experts whose name contains an entry of fqns.
void convert_grouped_experts(LanguageModelImpl& model, const Float8Conversion& c, Float8Conversion& out,
                             bool require_some) {
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* experts = dynamic_cast<nn::GroupedExpertsImpl*>(item.value().get());
    if (!experts) continue;
    const std::string& name = item.key();
    if (std::none_of(c.grouped_fqns.begin(), c.grouped_fqns.end(),
                     [&](const std::string& f) { return name.find(f) != std::string::npos; }))
      continue;
    const int64_t hidden = experts->w1.size(1), dim = experts->w1.size(2);
    TITAN_USER_CHECK(hidden % 16 == 0 && dim % 16 == 0, "model.converters \"", config::kFloat8GroupedConverter,
                     "\": the experts ", name, " (dim ", dim, ", hidden ", hidden, ") need multiples of 16 for float8 "
                     "grouped matmuls; leave them out of quantize.grouped_mm.float8.fqns");
    experts->float8 = c.grouped_recipe;
    out.grouped_converted.push_back(name);
  }
  if (!require_some) return;
  TITAN_USER_CHECK(!out.grouped_converted.empty(), "model.converters \"", config::kFloat8GroupedConverter,
                   "\" converted no MoE experts: ",
                   model.moe_layers().empty() ? std::string("the model has no mixture-of-experts layer")
                                              : "no experts' name contains an entry of quantize.grouped_mm.float8.fqns",
                   ". Set fqns = [\"experts\"], or drop the converter");
}

}  // namespace

void convert_to_float8(LanguageModelImpl& model, Float8Conversion& c, const config::Float8Linear& options,
                       bool record, bool require_some) {
  Float8Conversion local;
  Float8Conversion& out = record ? c : local;
  if (c.grouped_recipe) convert_grouped_experts(model, c, out, require_some);
  if (!c.recipe) return;
  const bool auto_filter = std::find(options.filter_fqns.begin(), options.filter_fqns.end(), kAutoFilter) !=
                           options.filter_fqns.end();
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get());
    if (!linear) continue;
    const std::string& name = item.key();
    const auto filtered = std::find_if(options.filter_fqns.begin(), options.filter_fqns.end(), [&](const std::string& f) {
      return !f.empty() && f != kAutoFilter && name.find(f) != std::string::npos;
    });
    if (filtered != options.filter_fqns.end()) {
      out.skipped.push_back(name + " (filter_fqns \"" + *filtered + "\")");
      continue;
    }
    const int64_t outf = linear->weight.size(0), in = linear->weight.size(1);
    if (outf % 16 != 0 || in % 16 != 0) {
      out.skipped.push_back(name + " (" + std::to_string(in) + " -> " + std::to_string(outf) +
                            ": float8 matmuls need multiples of 16)");
      continue;
    }
    if (auto_filter && too_small_for_float8(c.recipe->name, outf, in)) {
      out.skipped.push_back(name + " (" + std::to_string(in) + " -> " + std::to_string(outf) +
                            ": too small to gain from float8, auto_filter_small_kn)");
      continue;
    }
    linear->float8 = c.recipe;
    out.converted.push_back(name);
  }
  if (!require_some) return;
  TITAN_USER_CHECK(!out.converted.empty(), "model.converters \"", config::kFloat8Converter,
                   "\" converted no linear layer: ",
                   out.skipped.empty() ? std::string("the model has none") : first_of(out.skipped),
                   ". Remove names from quantize.linear.float8.filter_fqns, or drop the converter");
}

std::string model_description(const LanguageModelImpl& model) {
  std::ostringstream os;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const std::string& name = item.key();
    const int64_t depth = std::count(name.begin(), name.end(), '.');
    std::string type = item.value()->name();
    if (const auto colon = type.rfind("::"); colon != std::string::npos) type = type.substr(colon + 2);
    if (type.size() > 4 && type.compare(type.size() - 4, 4, "Impl") == 0) type.resize(type.size() - 4);
    os << std::string(static_cast<size_t>(2 * depth), ' ') << name.substr(name.rfind('.') + 1) << ": " << type;
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      os << " " << p.key() << "(";
      for (int64_t d = 0; d < p.value().dim(); ++d) os << (d ? ", " : "") << p.value().size(d);
      os << ")";
    }
    if (const auto* linear = dynamic_cast<const nn::LinearImpl*>(item.value().get()); linear && linear->float8)
      os << " float8 " << linear->float8->name << (linear->float8->emulate ? " (emulated)" : "");
    if (const auto* experts = dynamic_cast<const nn::GroupedExpertsImpl*>(item.value().get()); experts && experts->float8)
      os << " float8 grouped " << experts->float8->name;
    os << "\n";
  }
  return os.str();
}

std::string describe(const Float8Conversion& c) {
  std::ostringstream os;
  if (c.recipe) {
    os << "float8 linear layers (recipe " << c.recipe->name << (c.recipe->emulate ? ", emulated" : "") << "): "
       << c.converted.size() << " converted";
    if (!c.skipped.empty()) os << "; kept in high precision: " << first_of(c.skipped);
  }
  if (c.grouped_recipe)
    os << (c.recipe ? "; " : "") << "float8 grouped matmuls (rowwise) of MoE experts: " << first_of(c.grouped_converted, 3);
  return os.str();
}

}  // namespace titan
