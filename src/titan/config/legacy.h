// Older torchtitan spellings, accepted unchanged and mapped onto the keys of job_config.h, and a few
// keys of torchtitan's that titan accepts only at the value that asks for nothing it lacks.
//
// torchtitan moved keys between tables over its releases: `[training] batch_size` became
// `local_batch_size`, the parallelism degrees moved from [training]/[experimental] to
// [parallelism], `warmup_steps` to [lr_scheduler], [float8] to [quantize.linear.float8], and a
// few switches were inverted (enable_color_printing -> disable_color_printing). Each entry here
// says where an older key now lives and how its value translates.
#pragma once

#include <string_view>
#include <vector>

namespace titan::config {

enum class LegacyKind {
  Rename,        // same value, stored at `target` ("section.key")
  Negate,        // boolean stored inverted at `target`
  Float8Switch,  // boolean: true puts the float8 converter into model.converters, false takes it out
  FixedValue,    // string that must be one of `target` ("a|b"): the only behavior titan has (no field stores it)
  NoEffect,      // accepted and type-checked; controls something titan does not have. `target`: the value's type,
                 // "bool", "int" or "float"
  OffOnly,       // boolean accepted only false (torchtitan's default): true asks for what titan does not do
  EmptyOnly,     // list of strings accepted only empty (torchtitan's default), for the same reason
};

struct LegacyKey {
  const char* section;  // table the older key lived in, e.g. "training" or "float8"
  const char* key;
  LegacyKind kind;
  const char* target;
  const char* note;     // shown in --help and docs
};

// The converter name that enables float8 linear layers (torchtitan >= 0.2; older: "float8").
inline constexpr const char* kFloat8Converter = "quantize.linear.float8";
inline constexpr const char* kFloat8GroupedConverter = "quantize.grouped_mm.float8";

const std::vector<LegacyKey>& legacy_keys();
// The entry for section.key, or nullptr.
const LegacyKey* find_legacy(std::string_view section, std::string_view key);
// Whether `section` is a table only older configs have (e.g. "float8").
bool is_legacy_section(std::string_view section);
// For a key or table of torchtitan's that titan does not implement (path "section.key", or a table
// such as "quantize.linear.mx" and anything under it): why, and what to use instead; else nullptr.
const char* unsupported_reason(std::string_view path);

}  // namespace titan::config
