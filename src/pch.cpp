// Compiles src/pch.h once for the programs that share it (see CMakeLists.txt).
