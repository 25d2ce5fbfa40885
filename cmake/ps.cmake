# The parameter server's transport (docs/ps.md, "Transport"): gRPC and protobuf from Debian
# (libgrpc++-dev, protobuf-compiler-grpc). The generated code is a library of its own, so that a
# change elsewhere never recompiles it, and gRPC's headers reach only src/ps/rpc.cpp and wire.cpp.
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

add_library(shoal_ps_proto STATIC ${shoal_ps_sources})
set_target_properties(shoal_ps_proto PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(shoal_ps_proto PUBLIC ${shoal_ps_generated})
target_link_libraries(shoal_ps_proto PUBLIC gRPC::grpc++ protobuf::libprotobuf)

# Service, client, the wire checks, the store-and-sum handler and how workers find servers.
add_library(shoal_ps_rpc STATIC
  src/ps/wire.cpp
  src/ps/rpc.cpp
  src/ps/sum_handler.cpp
  src/ps/connect.cpp
  src/ps/replica.cpp
)
set_target_properties(shoal_ps_rpc PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(shoal_ps_rpc PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(shoal_ps_rpc PUBLIC shoal PRIVATE shoal_ps_proto)
target_compile_options(shoal_ps_rpc PRIVATE ${SHOAL_WARNINGS})
