# shoal::torch: LibTorch 1.13 (Debian's libtorch-dev) with c10d's Gloo backend, as an imported
# target. Used by shoal's own build and installed beside shoalConfig.cmake, so that a program's
# find_package(shoal) finds the same LibTorch on its machine and gets the same flags.
#
# Debian's TorchConfig.cmake drags in Caffe2's CMake config; the few flags needed are set here
# instead: the C++ API's include dir, USE_C10D_GLOO (c10d's headers hide ProcessGroupGloo without
# it) and the four libraries. Sets SHOAL_TORCH_FOUND, and SHOAL_TORCH_MISSING to what was not found.
if(TARGET shoal::torch)
  set(SHOAL_TORCH_FOUND TRUE)
  return()
endif()
find_path(SHOAL_TORCH_INCLUDE torch/torch.h PATHS /usr/include/torch/csrc/api/include)
find_library(SHOAL_TORCH_LIB torch)
find_library(SHOAL_TORCH_CPU_LIB torch_cpu)
find_library(SHOAL_C10_LIB c10)
find_library(SHOAL_GLOO_LIB gloo)
set(SHOAL_TORCH_MISSING "")
foreach(var SHOAL_TORCH_INCLUDE SHOAL_TORCH_LIB SHOAL_TORCH_CPU_LIB SHOAL_C10_LIB SHOAL_GLOO_LIB)
  if(NOT ${var})
    list(APPEND SHOAL_TORCH_MISSING ${var})
  endif()
endforeach()
if(SHOAL_TORCH_MISSING)
  set(SHOAL_TORCH_FOUND FALSE)
  return()
endif()
set(SHOAL_TORCH_FOUND TRUE)
add_library(shoal::torch INTERFACE IMPORTED)
set_target_properties(shoal::torch PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "${SHOAL_TORCH_INCLUDE}"
  INTERFACE_COMPILE_DEFINITIONS USE_C10D_GLOO
  INTERFACE_LINK_LIBRARIES
    "${SHOAL_TORCH_LIB};${SHOAL_TORCH_CPU_LIB};${SHOAL_C10_LIB};${SHOAL_GLOO_LIB}")
