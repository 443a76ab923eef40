// Integers read from JSON files that may be damaged (checkpoint indexes, safetensors headers, token
// shard manifests, tokenizer files). nlohmann's get<int64_t>() casts a float, which is undefined
// behaviour when it is out of the integer's range (1e300 in a damaged file), and wraps integers too
// large for the type. These throw nlohmann::json::type_error instead, so that the callers' handlers of
// JSON errors report the file.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace titan {

template <class T>
T json_integer(const nlohmann::json& j) {
  static_assert(std::is_integral_v<T>);
  constexpr auto max = static_cast<uint64_t>(std::numeric_limits<T>::max());
  constexpr auto min = static_cast<int64_t>(std::numeric_limits<T>::min());
  if (j.is_number_unsigned() && j.get<uint64_t>() <= max) return static_cast<T>(j.get<uint64_t>());
  if (j.is_number_integer() && !j.is_number_unsigned()) {
    const int64_t v = j.get<int64_t>();
    if (v >= min && (v < 0 || static_cast<uint64_t>(v) <= max)) return static_cast<T>(v);
  }
  throw nlohmann::json::type_error::create(
      302, std::string("expected an integer from ") + std::to_string(min) + " to " + std::to_string(max) + ", got " +
               (j.is_number() ? j.dump() : std::string(j.type_name())),
      &j);
}

template <class T>
std::vector<T> json_integers(const nlohmann::json& j) {
  if (!j.is_array())
    throw nlohmann::json::type_error::create(302, std::string("expected a list of integers, got ") + j.type_name(), &j);
  std::vector<T> out;
  out.reserve(j.size());
  for (const auto& v : j) out.push_back(json_integer<T>(v));
  return out;
}

}  // namespace titan
