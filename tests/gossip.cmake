# Gossip membership (docs/elastic.md): real processes and UDP sockets on 127.0.0.1. Built without
# torch or the test harness, so that it builds in seconds. Included from tests/CMakeLists.txt.
add_executable(gossip_test gossip_test.cpp)
target_link_libraries(gossip_test PRIVATE shoal_gossip GTest::gtest_main Threads::Threads)
target_include_directories(gossip_test PRIVATE ${PROJECT_SOURCE_DIR}/src)  # white-box tests of the wire format and rules
target_compile_options(gossip_test PRIVATE ${SHOAL_WARNINGS})
# Timing-sensitive (docs/testing.md): they take the resource lock `timing`, and the test that
# loads the machine with busy loops for 20 s runs alone.
gtest_discover_tests(gossip_test TEST_FILTER "-*UnderCpuLoad" DISCOVERY_TIMEOUT 60
                     PROPERTIES TIMEOUT 120 RESOURCE_LOCK timing)
gtest_discover_tests(gossip_test TEST_FILTER "*UnderCpuLoad" DISCOVERY_TIMEOUT 60
                     PROPERTIES TIMEOUT 120 RUN_SERIAL TRUE)
