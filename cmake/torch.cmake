# LibTorch 1.13 from Debian's libtorch-dev, with c10d's Gloo backend: the target shoal::torch
# (cmake/shoalTorch.cmake, which the installed CMake package uses too).
include(${CMAKE_CURRENT_LIST_DIR}/shoalTorch.cmake)
if(NOT SHOAL_TORCH_FOUND)
  message(FATAL_ERROR "shoal needs LibTorch 1.13 with Gloo; not found: ${SHOAL_TORCH_MISSING} "
                      "(scripts/setup.sh installs libtorch-dev and libgloo-dev)")
endif()
