# Global tensors (docs/global.md): placements, SBP and boxing against the one-process value.
shoal_add_test(global_test global_test.cpp)
shoal_add_test(global_ops_test global_ops_test.cpp)
