#include "titan/components/metrics/peak_flops.h"

#include <algorithm>
#include <cctype>

namespace titan::metrics {

const std::vector<PeakFlopsEntry>& peak_flops_table() {
  // Figures: NVIDIA datasheets, dense (half the "with sparsity" figures), bf16 with fp32 accumulate.
  static const std::vector<PeakFlopsEntry> table = {
      {"GB300", "", 2.5e15, "GB300 (per Blackwell Ultra GPU)"},
      {"GB200", "", 2.5e15, "GB200 (per Blackwell GPU)"},
      {"B300", "", 2.25e15, "B300"},
      {"B200", "", 2.25e15, "B200"},
      {"H200", "", 989e12, "H200"},
      {"H100", "NVL", 835e12, "H100 NVL"},
      {"H100", "PCIE", 756e12, "H100 PCIe"},
      {"H100", "", 989e12, "H100 SXM (and other H100 variants)"},
      {"H20", "", 148e12, "H20"},
      {"A100", "", 312e12, "A100"},
      {"A800", "", 312e12, "A800"},
      {"A10G", "", 70e12, "A10G (AWS)"},
      {"A10", "", 125e12, "A10"},
      {"A6000", "", 154.85e12, "RTX A6000"},
      {"A40", "", 149.7e12, "A40"},
      {"L40S", "", 362.05e12, "L40S"},
      {"L40", "", 181.05e12, "L40"},
      {"L4", "", 121e12, "L4"},
  };
  return table;
}

std::optional<double> peak_flops_for_device(const std::string& device_name) {
  std::string name = device_name;
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::toupper(c); });
  // `s` occurs in the name and is not followed by another digit: "A10" is not in "A100", nor "A40"
  // in "RTX A4000".
  auto has = [&name](const char* s) {
    const size_t len = std::char_traits<char>::length(s);
    for (size_t pos = name.find(s); pos != std::string::npos; pos = name.find(s, pos + 1)) {
      const size_t next = pos + len;
      if (next == name.size() || !std::isdigit(static_cast<unsigned char>(name[next]))) return true;
    }
    return false;
  };
  for (const PeakFlopsEntry& row : peak_flops_table()) {
    if (!has(row.substring.c_str()) || (!row.qualifier.empty() && !has(row.qualifier.c_str()))) continue;
    return row.flops;
  }
  return std::nullopt;
}

}  // namespace titan::metrics
