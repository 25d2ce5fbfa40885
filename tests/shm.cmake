# Collectives among co-located workers through shared memory (docs/comm.md, "Shared memory among
# co-located workers (in progress)"): real forked processes. Built without torch or the test
# harness, so that it builds in seconds. Included from tests/CMakeLists.txt.
add_executable(shm_test shm_test.cpp)
target_link_libraries(shm_test PRIVATE shoal_shm GTest::gtest_main Threads::Threads)
target_compile_options(shm_test PRIVATE ${SHOAL_WARNINGS})
# The fault tests assert how long a failure takes to surface (docs/testing.md): resource lock
# `timing`, as gossip's and etcd's tests.
gtest_discover_tests(shm_test DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 300 RESOURCE_LOCK timing)
