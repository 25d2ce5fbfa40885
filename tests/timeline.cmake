# The timeline (docs/runtime.md, "Timeline (SHOAL_TIMELINE)"): real workers write one trace.
shoal_add_test(timeline_test timeline_test.cpp)
