#include "titan/common/assets.h"

#include <filesystem>

namespace titan {

namespace fs = std::filesystem;

std::string find_asset(const std::string& relative) {
  std::error_code ec;
  if (fs::exists(relative, ec)) return relative;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  fs::path dir = exe.parent_path();
  for (int up = 0; up < 4 && !dir.empty(); ++up, dir = dir.parent_path()) {
    if (fs::exists(dir / relative, ec)) return (dir / relative).string();
    if (dir == dir.parent_path()) break;
  }
  return {};
}

}  // namespace titan
