# Global tensors (docs/global.md): placements, SBP and boxing against the one-process value.
shoal_add_test(global_test global_test.cpp)
shoal_add_test(global_ops_test global_ops_test.cpp)
if(TARGET global_gpt)
  # The examples under `shoal run`: OneFlow's matmul programs and the GPT in each plan.
  shoal_add_test(global_examples_test global_examples_test.cpp PROPERTIES COST 60)
  add_dependencies(global_examples_test global_data_parallel global_model_parallel global_pipeline global_gpt shoal_cli)
endif()
shoal_add_test(global_nn_test global_nn_test.cpp)
shoal_add_test(checkpoint_global_test checkpoint_global_test.cpp)
