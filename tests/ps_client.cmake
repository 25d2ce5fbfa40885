# Parameter-server training as a program writes it (docs/ps.md, "The program"): shoal::ps::Optimizer
# and ps::Embedding on real `shoal run --servers` jobs, against one process with torch::optim.
add_executable(ps_train programs/ps_train.cpp)
shoal_program(ps_train)
target_include_directories(ps_train PRIVATE ${PROJECT_SOURCE_DIR}/src)
shoal_add_test(ps_client_test ps_client_test.cpp)
add_dependencies(ps_client_test shoal_cli ps_train)
