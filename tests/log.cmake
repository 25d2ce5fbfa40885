# shoal's logger (src/core/log.h, docs/runtime.md "Logging"): torch-free, forked children.
# Included from tests/CMakeLists.txt.
add_executable(log_test log_test.cpp)
target_link_libraries(log_test PRIVATE shoal_base GTest::gtest_main)
target_compile_options(log_test PRIVATE ${SHOAL_WARNINGS})
gtest_discover_tests(log_test DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 60)
