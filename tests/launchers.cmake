# shoal programs under real launchers: a Slurm that each test starts (slurm_test) and Open MPI's
# mpirun (mpi_test, on this host and across two network-namespace hosts). Both skip with a
# message where root or the packages are missing.
add_executable(launched_worker programs/launched_worker.cpp)
shoal_program(launched_worker)
add_executable(host_worker programs/host_worker.cpp)
shoal_program(host_worker)
add_library(shoal_launcher_support STATIC slurm_cluster.cpp)
target_link_libraries(shoal_launcher_support PUBLIC shoal_test_support)
target_precompile_headers(shoal_launcher_support REUSE_FROM shoal_test_support)
shoal_add_test(slurm_test slurm_test.cpp)
shoal_add_test(mpi_test mpi_test.cpp)
foreach(test slurm_test mpi_test)
  target_link_libraries(${test} PRIVATE shoal_launcher_support)
  add_dependencies(${test} launched_worker)
endforeach()
add_dependencies(mpi_test host_worker)
