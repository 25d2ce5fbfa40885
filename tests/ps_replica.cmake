# Parameter servers that survive (docs/ps.md, "Replicas and snapshots"): the core's answer to a
# retried push; a primary and its backup over the real transport in one process; and
# `shoal run --ps-replicas 2` with a primary SIGKILLed mid-training.
shoal_add_test(ps_replica_test ps_replica_test.cpp PROPERTIES RESOURCE_LOCK timing)
target_include_directories(ps_replica_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(ps_replica_test PRIVATE shoal_ps_rpc)
add_dependencies(ps_replica_test shoal_cli ps_worker)
