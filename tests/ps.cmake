# Parameter servers (docs/ps.md). Included from tests/CMakeLists.txt.
# The server's core without the network: sharding, tables, optimizers against LibTorch and
# PyTorch's sparse optimizers (fixtures from tests/fixtures/ps), clocks with threads as workers.
shoal_add_test(ps_core_test ps_core_test.cpp)
target_include_directories(ps_core_test PRIVATE ${PROJECT_SOURCE_DIR}/src)  # white-box: src/ps is private
target_link_libraries(ps_core_test PRIVATE nlohmann_json::nlohmann_json)
target_compile_definitions(ps_core_test PRIVATE
  SHOAL_PS_FIXTURES="${CMAKE_CURRENT_SOURCE_DIR}/fixtures/ps")
