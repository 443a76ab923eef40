// Lists in messages: "a, b, c", or with another word before the last item ("a, b and c").
#pragma once

#include <iterator>
#include <string>
#include <type_traits>

namespace titan {

// The items of `items` (strings or numbers) separated by ", ", the last one by `last`.
template <typename Range>
std::string joined(const Range& items, const std::string& last = ", ") {
  std::string out;
  const auto n = std::distance(std::begin(items), std::end(items));
  decltype(std::distance(std::begin(items), std::end(items))) k = 0;
  for (const auto& item : items) {
    if (k > 0) out += k + 1 == n ? last : std::string(", ");
    if constexpr (std::is_arithmetic_v<std::decay_t<decltype(item)>>)
      out += std::to_string(item);
    else
      out += std::string(item);
    ++k;
  }
  return out;
}

}  // namespace titan
