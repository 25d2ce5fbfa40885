# A static job over two network namespaces joined by a veth pair (needs root; skips otherwise).
# Included from tests/CMakeLists.txt with include(multihost.cmake OPTIONAL).
shoal_add_test(multihost_test multihost_test.cpp)
add_executable(multihost_worker programs/multihost_worker.cpp)
shoal_program(multihost_worker)
add_dependencies(multihost_test multihost_worker ps_worker shoal_cli)
