# The parameter server's transport and processes (docs/ps.md): real `shoal ps-server` processes,
# real clients, and `shoal run --servers` with a worker that pushes and pulls through them.
add_executable(ps_worker programs/ps_worker.cpp)
shoal_program(ps_worker)
target_link_libraries(ps_worker PRIVATE shoal_ps_rpc)
shoal_add_test(ps_rpc_test ps_rpc_test.cpp)
target_link_libraries(ps_rpc_test PRIVATE shoal_ps_grpc)
add_dependencies(ps_rpc_test shoal_cli ps_worker)
# gRPC's flags define _REENTRANT, which the shared precompiled header was built without.
set_target_properties(ps_rpc_test PROPERTIES DISABLE_PRECOMPILE_HEADERS ON)
