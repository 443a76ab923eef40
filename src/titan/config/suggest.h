// "Did you mean ...?": the nearest candidate by edit distance, for unknown keys and values.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace titan::config {

// Levenshtein distance (insertions, deletions, substitutions each cost 1).
size_t edit_distance(std::string_view a, std::string_view b);

// The candidate closest to `word`, if it is close enough to be a plausible typo: at most
// max(2, |word| / 3) edits, or one candidate containing the other (e.g. "batch_size" in
// "local_batch_size"). Ties go to the earlier candidate.
std::optional<std::string> nearest(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace titan::config
