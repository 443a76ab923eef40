#include "titan/models/common/init.h"

#include "titan/common/tensor_storage.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>

namespace titan::init {
namespace {

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Draw with `fill` into an fp32 CPU tensor of param's shape, then copy into param.
template <typename Fill>
void draw(at::Tensor& param, Fill fill) {
  if (!has_storage(param)) return;
  c10::NoGradGuard no_grad;
  at::Tensor values = at::empty(param.sizes(), at::TensorOptions().dtype(at::kFloat));
  fill(values);
  param.copy_(values);
}

double norm_cdf(double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; }

}  // namespace

at::Generator param_generator(uint64_t seed, std::string_view name) {
  return at::make_generator<at::CPUGeneratorImpl>(splitmix64(seed ^ splitmix64(fnv1a(name))));
}

void normal(at::Tensor& param, uint64_t seed, std::string_view name, double mean, double std) {
  draw(param, [&](at::Tensor& v) { v.normal_(mean, std, param_generator(seed, name)); });
}

void trunc_normal(at::Tensor& param, uint64_t seed, std::string_view name, double mean, double std,
                  double a, double b) {
  draw(param, [&](at::Tensor& v) {
    // Uniform in CDF space between the cut-offs, mapped back through the inverse normal CDF.
    const double lo = norm_cdf((a - mean) / std), hi = norm_cdf((b - mean) / std);
    v.uniform_(2 * lo - 1, 2 * hi - 1, param_generator(seed, name));
    v.erfinv_().mul_(std * std::sqrt(2.0)).add_(mean).clamp_(a, b);
  });
}

void ones(at::Tensor& param) {
  if (!has_storage(param)) return;
  c10::NoGradGuard no_grad;
  param.fill_(1.0);
}

}  // namespace titan::init
