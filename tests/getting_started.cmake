# docs/getting-started.md's programs (examples/getting_started): the size of the change, and the
# distributed one on 3 workers against one process.
shoal_add_test(getting_started_test getting_started_test.cpp PROPERTIES COST 50)
add_dependencies(getting_started_test getting_started_plain getting_started_distributed shoal_cli)
