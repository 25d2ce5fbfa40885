# Elastic jobs end to end (docs/elastic.md): `shoal run --min/--max` with a small training program.
shoal_add_test(elastic_test elastic_test.cpp etcd_server.cpp)
add_executable(elastic_worker programs/elastic_worker.cpp)
shoal_program(elastic_worker)
add_dependencies(elastic_test elastic_worker shoal_cli)
