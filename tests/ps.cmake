# Parameter servers (docs/ps.md). Included from tests/CMakeLists.txt.
# The server's core without the network, white-box (src/ps is private): where values live and
# how rows start; the optimizers against LibTorch and PyTorch's sparse optimizers (fixtures from
# tests/fixtures/ps); the clocks with threads as workers.
foreach(test ps_shard_test ps_optimizer_test ps_server_core_test ps_ledger_test)
  shoal_add_test(${test} ${test}.cpp)
  target_include_directories(${test} PRIVATE ${PROJECT_SOURCE_DIR}/src)
endforeach()
target_link_libraries(ps_optimizer_test PRIVATE nlohmann_json::nlohmann_json)
