# The parameter server's transport (docs/ps.md, "Transport"): gRPC and protobuf from Debian
# (libgrpc++-dev, protobuf-compiler-grpc). gRPC's headers reach only src/ps/rpc_server.cpp, rpc_client.cpp and wire.cpp.
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_program(SHOAL_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)

set(shoal_ps_proto ${PROJECT_SOURCE_DIR}/src/ps/ps.proto)
set(shoal_ps_generated ${PROJECT_BINARY_DIR}/generated/ps)
set(shoal_ps_sources ${shoal_ps_generated}/ps.pb.cc ${shoal_ps_generated}/ps.grpc.pb.cc)
add_custom_command(
  OUTPUT ${shoal_ps_sources} ${shoal_ps_generated}/ps.pb.h ${shoal_ps_generated}/ps.grpc.pb.h
  COMMAND ${CMAKE_COMMAND} -E make_directory ${shoal_ps_generated}
  COMMAND protobuf::protoc --proto_path=${PROJECT_SOURCE_DIR}/src/ps
          --cpp_out=${shoal_ps_generated} --grpc_out=${shoal_ps_generated}
          --plugin=protoc-gen-grpc=${SHOAL_GRPC_CPP_PLUGIN} ${shoal_ps_proto}
  DEPENDS ${shoal_ps_proto}
  COMMENT "Generating the parameter server's gRPC code from ps.proto")

# The transport's code is part of libshoal (shoal::ps::Optimizer's clients use it), compiled as
# object libraries of their own: gRPC's flags (_REENTRANT) differ from the library's precompiled
# header's, and a change elsewhere in the library never recompiles them.
add_library(shoal_ps_proto_objects OBJECT ${shoal_ps_sources})
set_target_properties(shoal_ps_proto_objects PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(shoal_ps_proto_objects PUBLIC ${shoal_ps_generated})
target_link_libraries(shoal_ps_proto_objects PUBLIC gRPC::grpc++ protobuf::libprotobuf)

# Service, client, the wire checks, the store-and-sum handler and how workers find servers.
add_library(shoal_ps_rpc_objects OBJECT
  src/ps/wire.cpp
  src/ps/rpc_server.cpp
  src/ps/rpc_client.cpp
  src/ps/sum_handler.cpp
  src/ps/connect.cpp
  src/ps/replica.cpp
  src/ps/shm.cpp
  src/ps/mirror.cpp
)
set_target_properties(shoal_ps_rpc_objects PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(shoal_ps_rpc_objects PRIVATE ${PROJECT_SOURCE_DIR}/include
                           ${PROJECT_SOURCE_DIR}/src ${shoal_ps_generated})
target_link_libraries(shoal_ps_rpc_objects PRIVATE shoal::torch Threads::Threads gRPC::grpc++
                      protobuf::libprotobuf)
target_compile_options(shoal_ps_rpc_objects PRIVATE ${SHOAL_WARNINGS})
add_dependencies(shoal_ps_rpc_objects shoal_ps_proto_objects)  # the generated headers

target_sources(shoal PRIVATE $<TARGET_OBJECTS:shoal_ps_proto_objects>
                             $<TARGET_OBJECTS:shoal_ps_rpc_objects>)
target_link_libraries(shoal PRIVATE gRPC::grpc++ protobuf::libprotobuf)

# For shoal's own programs that reach into the transport (the command, tests, benchmarks): its
# internal headers (src/ps/rpc.h and the rest, which include no gRPC); the code is libshoal's.
add_library(shoal_ps_rpc INTERFACE)
target_include_directories(shoal_ps_rpc INTERFACE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(shoal_ps_rpc INTERFACE shoal)
# For the few that call gRPC themselves (the transport's tests, its benchmark): the generated
# headers and gRPC's flags, which the shared precompiled header was built without.
add_library(shoal_ps_grpc INTERFACE)
target_include_directories(shoal_ps_grpc INTERFACE ${shoal_ps_generated})
target_link_libraries(shoal_ps_grpc INTERFACE shoal_ps_rpc gRPC::grpc++ protobuf::libprotobuf)
