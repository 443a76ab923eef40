// Peak dense bf16 tensor-core FLOP/s of NVIDIA GPUs, looked up by device name (the name CUDA
// reports, e.g. "NVIDIA H100 80GB HBM3"), for model FLOPs utilization (MFU).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace titan::metrics {

// One row of the table: a device matches when its upper-cased name contains `substring` (not
// followed by another digit: "A10" does not match "A100") and,
// when `qualifier` is not empty, also `qualifier` (e.g. "H100" with "NVL").
struct PeakFlopsEntry {
  std::string substring;
  std::string qualifier;
  double flops;       // dense bf16, FLOP/s per device (without 2:4 sparsity)
  std::string model;  // the product the figure is for, for documentation
};

// The table in matching order: the first matching row wins, so more specific names come first
// ("A100" before "A10", "H200" before "H20", "GB200" before "B200", "L40S" before "L40" before "L4").
const std::vector<PeakFlopsEntry>& peak_flops_table();

// Peak dense bf16 FLOP/s of the device named `device_name` (case-insensitive substring match, as
// torchtitan's get_peak_flops), or nothing when the device is not in the table (CPU, unknown GPUs).
std::optional<double> peak_flops_for_device(const std::string& device_name);

}  // namespace titan::metrics
