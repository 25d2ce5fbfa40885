// What the extension's sources share (src/python): building a C++ module over a Python module's
// tensors, deadlines from Python, and each source's bindings.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <torch/nn/module.h>

#include "shoal/core/timeout.h"

namespace shoal::python {

using Named = std::vector<std::pair<std::string, at::Tensor>>;

// A C++ module that registers these very tensors under their names, nested at each '.', with a
// submodule for each of `modules` too, tensors or none (a ReLU's), as a C++ model has (Note [A
// Python module's tensors in C++], bindings.cpp).
std::shared_ptr<torch::nn::Module> mirror(const Named& parameters, const Named& buffers,
                                          const std::vector<std::string>& modules = {});

// A deadline from Python: seconds, or None for the group's. UsageError for a number not above 0.
Duration deadline(const std::optional<double>& seconds);

// shoal._C's checkpoint functions and its optimizer mirror (checkpoint.cpp).
void bind_checkpoint(pybind11::module_& m);

}  // namespace shoal::python
