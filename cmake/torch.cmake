# LibTorch 1.13 from Debian's libtorch-dev, with c10d's Gloo backend.
# Debian's TorchConfig.cmake drags in Caffe2's CMake config; the few flags needed are set here
# instead (see ../shared/FINDINGS.md).
find_path(SHOAL_TORCH_INCLUDE torch/torch.h PATHS /usr/include/torch/csrc/api/include REQUIRED)
find_library(SHOAL_TORCH_LIB torch REQUIRED)
find_library(SHOAL_TORCH_CPU_LIB torch_cpu REQUIRED)
find_library(SHOAL_C10_LIB c10 REQUIRED)
find_library(SHOAL_GLOO_LIB gloo REQUIRED)
add_library(shoal_torch INTERFACE)
add_library(shoal::torch ALIAS shoal_torch)
target_include_directories(shoal_torch SYSTEM INTERFACE ${SHOAL_TORCH_INCLUDE})
target_compile_definitions(shoal_torch INTERFACE USE_C10D_GLOO)
target_link_libraries(shoal_torch INTERFACE
  ${SHOAL_TORCH_LIB} ${SHOAL_TORCH_CPU_LIB} ${SHOAL_C10_LIB} ${SHOAL_GLOO_LIB})
