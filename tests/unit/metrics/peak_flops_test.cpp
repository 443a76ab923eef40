// Peak-FLOP/s lookups by the names CUDA reports, against the datasheet figures (dense bf16).
#include "titan/components/metrics/crc32c.h"
#include "titan/components/metrics/peak_flops.h"

#include <gtest/gtest.h>

namespace titan::metrics {
namespace {

TEST(MetricsPeakFlops, NvidiaDeviceNames) {
  const std::vector<std::pair<std::string, double>> expected = {
      {"NVIDIA H100 80GB HBM3", 989e12},   // SXM
      {"NVIDIA H100 PCIe", 756e12},
      {"NVIDIA H100 NVL", 835e12},
      {"NVIDIA H200", 989e12},
      {"NVIDIA H200 NVL", 989e12},
      {"NVIDIA H20", 148e12},
      {"NVIDIA A100-SXM4-80GB", 312e12},
      {"NVIDIA A100-PCIE-40GB", 312e12},
      {"NVIDIA A100 80GB PCIe", 312e12},
      {"NVIDIA B200", 2.25e15},
      {"NVIDIA GB200", 2.5e15},
      {"NVIDIA L40S", 362.05e12},
      {"nvidia l40s", 362.05e12},  // case-insensitive
      {"NVIDIA L40", 181.05e12},
      {"NVIDIA L4", 121e12},
      {"NVIDIA A10G", 70e12},
      {"NVIDIA A10", 125e12},
      {"NVIDIA A40", 149.7e12},
      {"NVIDIA RTX A6000", 154.85e12},
  };
  for (const auto& [name, flops] : expected) {
    auto peak = peak_flops_for_device(name);
    ASSERT_TRUE(peak.has_value()) << name;
    EXPECT_EQ(*peak, flops) << name;
  }
}

TEST(MetricsPeakFlops, UnknownDevicesHaveNoPeak) {
  for (const char* name : {"CPU", "", "Tesla V100-SXM2-16GB", "NVIDIA RTX A4000", "NVIDIA GeForce RTX 4090", "AMD EPYC"}) {
    EXPECT_FALSE(peak_flops_for_device(name).has_value()) << name;
  }
}

// Published CRC-32C check values: the standard check string and the iSCSI vectors of RFC 3720 B.4.
TEST(MetricsCrc32c, KnownVectors) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending += static_cast<char>(i);
    descending += static_cast<char>(31 - i);
  }
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(crc32c(descending), 0x113FDB5Cu);
  // Continuing a CRC over a split input gives the CRC of the whole.
  EXPECT_EQ(crc32c("56789", crc32c("1234")), 0xE3069283u);
}

TEST(MetricsCrc32c, Mask) {
  // mask(crc) = rotate_right(crc, 15) + 0xa282ead8, modulo 2^32.
  EXPECT_EQ(mask_crc32c(0), 0xa282ead8u);
  EXPECT_EQ(mask_crc32c(1u << 15), 0xa282ead8u + 1u);
  EXPECT_EQ(mask_crc32c(1), (1u << 17) + 0xa282ead8u);
}

}  // namespace
}  // namespace titan::metrics
