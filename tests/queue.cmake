# The job queue (docs/queue.md). The policy's tests build without torch or the harness.
add_executable(queue_policy_test queue_policy_test.cpp)
target_link_libraries(queue_policy_test PRIVATE shoal_queue_policy GTest::gtest_main)
target_compile_options(queue_policy_test PRIVATE ${SHOAL_WARNINGS})
gtest_discover_tests(queue_policy_test DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 60)
add_executable(queue_throughput_test queue_throughput_test.cpp)
target_link_libraries(queue_throughput_test PRIVATE shoal_queue_policy GTest::gtest_main)
target_compile_options(queue_throughput_test PRIVATE ${SHOAL_WARNINGS})
gtest_discover_tests(queue_throughput_test DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 60)

# The queue end to end: the real `shoal queue serve` with its agent and elastic training jobs.
# Timing-sensitive (a first step within 5 s of submission): the resource lock `timing`.
shoal_add_test(queue_test queue_test.cpp PROPERTIES RESOURCE_LOCK timing)
target_link_libraries(queue_test PRIVATE shoal_queue_http)
add_dependencies(queue_test shoal_cli elastic_worker)

# The queue across two network-namespace hosts, an agent on each (needs root; skips otherwise).
shoal_add_test(queue_multihost_test queue_multihost_test.cpp PROPERTIES RESOURCE_LOCK timing)
target_link_libraries(queue_multihost_test PRIVATE shoal_queue_http)
add_dependencies(queue_multihost_test shoal_cli elastic_worker)

# The dashboard in headless Chromium (Debian's chromium; skipped without it), on the real queue.
shoal_add_test(queue_dashboard_test queue_dashboard_test.cpp PROPERTIES RESOURCE_LOCK timing)
target_link_libraries(queue_dashboard_test PRIVATE shoal_queue_http)
add_dependencies(queue_dashboard_test shoal_cli elastic_worker)

# The queue on a real Slurm that the test starts (docs/queue.md, "Slurm"): one `shoal agent
# --engine slurm` per node. Skips with a message where root or the Slurm packages are missing.
shoal_add_test(queue_slurm_test queue_slurm_test.cpp PROPERTIES RESOURCE_LOCK timing)
target_link_libraries(queue_slurm_test PRIVATE shoal_queue_http shoal_launcher_support)
add_dependencies(queue_slurm_test shoal_cli elastic_worker)

# Resizing by checkpoint-restart (`shoal queue serve --resize-by restart`), bench/queue_real's
# baseline: a job shrunk and grown by restart resumes from its commit and loses no sample.
shoal_add_test(queue_restart_test queue_restart_test.cpp PROPERTIES RESOURCE_LOCK timing)
target_link_libraries(queue_restart_test PRIVATE shoal_queue_http)
add_dependencies(queue_restart_test shoal_cli elastic_worker)

# The scheduler as a service (docs/queue.md, "Running the queue"): an agent stopped, a second
# scheduler, a port in use, flags, REST errors, half-open clients.
shoal_add_test(queue_service_test queue_service_test.cpp PROPERTIES RESOURCE_LOCK timing)
target_link_libraries(queue_service_test PRIVATE shoal_queue_http)
add_dependencies(queue_service_test shoal_cli elastic_worker)

# The queue's security model (docs/queue.md, "Security"): credentials, users and the Unix users
# their jobs run as, allowed programs, the dashboard's login. Cases that need root skip without.
shoal_add_test(queue_security_test queue_security_test.cpp PROPERTIES RESOURCE_LOCK timing)
target_link_libraries(queue_security_test PRIVATE shoal_queue_http)
add_dependencies(queue_security_test shoal_cli elastic_worker)
