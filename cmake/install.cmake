# What `cmake --install` puts under the prefix, and the Debian packages CPack makes of it
# (docs/getting-started.md). Three components, as Debian splits a library:
#   runtime      the library and the `shoal` command                  -> package shoal
#   development  headers, CMake package, pkg-config file, libshoal.so  -> package shoal-dev
#   python       the Python package (src/python/CMakeLists.txt)       -> package python3-shoal
include(CMakePackageConfigHelpers)

set(SHOAL_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/shoal)

# shoal_datasets: the demo datasets' library (shoal::datasets, include/shoal/datasets/).
install(TARGETS shoal shoal_datasets EXPORT shoalTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT development)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/shoal DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  COMPONENT development)

# find_package(shoal): shoal::shoal, which brings shoal::torch (cmake/shoalTorch.cmake) along, and
# shoal::datasets for a program that uses the demo datasets.
install(EXPORT shoalTargets NAMESPACE shoal:: DESTINATION ${SHOAL_CMAKE_DIR}
  COMPONENT development)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/shoalConfig.cmake.in
  ${PROJECT_BINARY_DIR}/shoalConfig.cmake INSTALL_DESTINATION ${SHOAL_CMAKE_DIR})
# 0.x releases change the interface between minor versions.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/shoalConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/shoalConfig.cmake ${PROJECT_BINARY_DIR}/shoalConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/shoalTorch.cmake DESTINATION ${SHOAL_CMAKE_DIR}
  COMPONENT development)

# pkg-config: the same flags. The file is written when installing, with the prefix installed to,
# so that a copy installed with `cmake --install build --prefix DIR` points into DIR, and a
# package's into /usr.
set(SHOAL_PC_PREFIX "@CMAKE_INSTALL_PREFIX@")  # left for the install step to fill
set(SHOAL_PC_TORCH_CFLAGS "-I${SHOAL_TORCH_INCLUDE} -DUSE_C10D_GLOO")
set(SHOAL_PC_TORCH_LIBS "")
set(SHOAL_PC_LIB_DIRS "")
foreach(lib ${SHOAL_TORCH_LIB} ${SHOAL_TORCH_CPU_LIB} ${SHOAL_C10_LIB} ${SHOAL_GLOO_LIB})
  get_filename_component(dir ${lib} DIRECTORY)
  get_filename_component(name ${lib} NAME_WE)
  string(REGEX REPLACE "^lib" "" name ${name})
  if(NOT dir IN_LIST CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES AND NOT dir IN_LIST SHOAL_PC_LIB_DIRS)
    list(APPEND SHOAL_PC_LIB_DIRS ${dir})
    string(APPEND SHOAL_PC_TORCH_LIBS "-L${dir} ")
  endif()
  string(APPEND SHOAL_PC_TORCH_LIBS "-l${name} ")
endforeach()
string(STRIP "${SHOAL_PC_TORCH_LIBS}" SHOAL_PC_TORCH_LIBS)
configure_file(${PROJECT_SOURCE_DIR}/cmake/shoal.pc.in ${PROJECT_BINARY_DIR}/shoal.pc.install @ONLY)
install(CODE "
  set(pc \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR}/pkgconfig/shoal.pc\")
  message(STATUS \"Installing: \${pc}\")
  configure_file(\"${PROJECT_BINARY_DIR}/shoal.pc.install\" \"\${pc}\" @ONLY)
  " COMPONENT development)

# CPack: `cpack -G DEB` in the build directory makes shoal_<version>_<arch>.deb and
# shoal-dev_<version>_<arch>.deb, which `apt install ./shoal_*.deb ./shoal-dev_*.deb` installs
# with their dependencies. The runtime package depends on exactly the Debian packages of the
# libraries libshoal.so and the command load (tests/install_test.sh checks the list against
# their NEEDED entries; Gloo comes in through libtorch1.13); the development package on the
# headers and libraries its users compile and link against.
set(CPACK_PACKAGE_NAME shoal)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "Distributed training for LibTorch programs")
set(CPACK_PACKAGE_DESCRIPTION "shoal makes a LibTorch (PyTorch C++) training program distributed: \
data parallelism, global tensors with placement and SBP, and elastic, fault-tolerant jobs, started \
with the shoal command.")
set(SHOAL_PACKAGE_MAINTAINER "shoal developers <shoal@localhost>" CACHE STRING
    "The Maintainer field of the Debian packages")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${SHOAL_PACKAGE_MAINTAINER}")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL runtime development)
if(TARGET shoal_python)
  list(APPEND CPACK_COMPONENTS_ALL python)
endif()
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME shoal)
# The `shoal` command serves parameter servers over gRPC: libgrpc++1.51, libgrpc29 (libgpr),
# libabsl20220623 and libprotobuf32; its job queue keeps its state in SQLite (libsqlite3-0) and
# speaks HTTP through cpp-httplib (libcpp-httplib0.11), as the library does to etcd; its processes log through spdlog
# (libspdlog1.10, which brings libfmt9 along).
set(CPACK_DEBIAN_RUNTIME_PACKAGE_DEPENDS
    "libtorch1.13, libssl3, zlib1g, libgrpc++1.51, libgrpc29, libabsl20220623, libprotobuf32, libsqlite3-0, libcpp-httplib0.11, libspdlog1.10, libstdc++6, libgcc-s1, libc6")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_RECOMMENDS "libopenblas0-openmp")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_NAME shoal-dev)
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_DEPENDS
    "shoal (= ${PROJECT_VERSION}), libtorch-dev, libgloo-dev")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_RECOMMENDS "cmake, pkg-config, g++")
# The extension loads libshoal and LibTorch's libraries (libtorch1.13, through shoal); Python code
# imports torch, which python3-torch is, for the interpreter it was built for.
set(CPACK_DEBIAN_PYTHON_PACKAGE_NAME python3-shoal)
set(CPACK_DEBIAN_PYTHON_PACKAGE_SECTION python)
set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS
    "shoal (= ${PROJECT_VERSION}), python3-torch, ${SHOAL_PYTHON_DEPENDS}")
include(CPack)
