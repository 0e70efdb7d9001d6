// What the kernels use of torch: tensors, their factory ops, the parallel loop, dtype dispatch, and pybind11 with
// torch's tensor casters. <torch/extension.h> (all of ATen and the C++ frontend) instead made up most of each
// kernel's build: ~34 s of compiler time for the header alone on 2-core Zen 4, ~14 s for these.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
