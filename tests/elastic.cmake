# Elastic jobs end to end (docs/elastic.md): `shoal run --min/--max` with a small training program.
add_executable(elastic_worker programs/elastic_worker.cpp)
shoal_program(elastic_worker)
# The training state's side (oracles, commits, policies), the membership's side (stopped
# workers, tokens, usage errors, etcd restarts, partitions), and sharded models (ZeRO).
foreach(name elastic_test elastic_membership_test elastic_zero_test)
  shoal_add_test(${name} ${name}.cpp etcd_server.cpp)
  add_dependencies(${name} elastic_worker shoal_cli)
endforeach()
# elastic_test reads the job's keys in etcd with the backend's own client.
target_link_libraries(elastic_test PRIVATE shoal_etcd)
# The elastic example (examples/elastic_fashion_mnist.cpp) is run by elastic_test.
add_dependencies(elastic_test elastic_fashion_mnist)
