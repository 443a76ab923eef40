// CRC-32C (Castagnoli polynomial), the checksum of TFRecord files such as TensorBoard event files.
//
// A TFRecord stores "masked" CRCs: mask(crc) = rotate_right(crc, 15) + 0xa282ead8, so that a CRC
// computed over data that itself contains CRCs does not degenerate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace titan::metrics {

// CRC-32C of `data`, continuing from the CRC `crc` of the bytes before it (0 for a fresh start).
// crc32c("123456789") == 0xE3069283.
uint32_t crc32c(std::string_view data, uint32_t crc = 0);

// The masked form of a CRC-32C that TFRecord framing stores.
uint32_t mask_crc32c(uint32_t crc);

// mask_crc32c(crc32c(data)).
inline uint32_t masked_crc32c(std::string_view data) { return mask_crc32c(crc32c(data)); }

}  // namespace titan::metrics
