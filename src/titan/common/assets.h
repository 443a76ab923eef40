// Finding the repository's bundled files (assets/...) from wherever titan runs.
#pragma once

#include <string>

namespace titan {

// `relative` as given when it exists from the current folder; else the first of the titan binary's
// folder and its parents (up to 4 levels, so build/titan finds the repository's assets/) that holds
// it; else empty.
std::string find_asset(const std::string& relative);

}  // namespace titan
