# The etcd backend of elastic rendezvous (docs/elastic.md): a real etcd server that the tests
# start themselves (tests/etcd_server.h), workers as threads and forked processes. No torch and
# no test harness, so that it builds in seconds. Included from tests/CMakeLists.txt.
add_executable(etcd_test etcd_test.cpp etcd_server.cpp)
target_link_libraries(etcd_test PRIVATE shoal_etcd GTest::gtest_main Threads::Threads)
target_compile_options(etcd_test PRIVATE ${SHOAL_WARNINGS})
# Timing-sensitive (docs/testing.md): they take the resource lock `timing`.
gtest_discover_tests(etcd_test DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 180 RESOURCE_LOCK timing)
