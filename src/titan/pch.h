// Precompiled header: the heavy, stable LibTorch headers every translation unit uses.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/optim/adamw.h>
#include <nlohmann/json.hpp>
#include <map>
#include <memory>
#include <string>
#include <vector>
