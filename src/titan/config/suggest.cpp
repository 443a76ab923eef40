#include "titan/config/suggest.h"

#include <algorithm>
#include <limits>

namespace titan::config {

size_t edit_distance(std::string_view a, std::string_view b) {
  // One row of the dynamic-programming table: row[j] = distance(a[0:i], b[0:j]).
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::optional<std::string> nearest(std::string_view word, const std::vector<std::string>& candidates) {
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  std::optional<std::string> best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const auto& c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  if (best && best_distance <= limit) return best;
  // A longer or shorter spelling of the same thing ("batch_size" vs "local_batch_size").
  if (word.size() >= 4) {
    for (const auto& c : candidates)
      if (c.find(word) != std::string::npos || (c.size() >= 4 && word.find(c) != std::string_view::npos)) return c;
  }
  return std::nullopt;
}

}  // namespace titan::config
