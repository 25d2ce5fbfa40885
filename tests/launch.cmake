# `shoal run` tests (docs/launch.md): the real binary with shell-script workers.
shoal_add_test(launch_test launch_test.cpp)
add_dependencies(launch_test shoal_cli)
