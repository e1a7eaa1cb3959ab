# CMake package configuration for an installed dtrain (make install).
#   find_package(dtrain 0.1 REQUIRED)
#   target_link_libraries(app PRIVATE dtrain::dtrain)
# dtrain is one header: define DTRAIN_IMPLEMENTATION in exactly one source file.
# The prefix is found from this file's own place (<prefix>/lib/cmake/dtrain),
# so an installed tree can be moved.
include(CMakeFindDependencyMacro)
find_dependency(Threads)
get_filename_component(_dtrain_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET dtrain::dtrain)
  add_library(dtrain::dtrain INTERFACE IMPORTED)
  set_target_properties(dtrain::dtrain PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${_dtrain_prefix}/include"
    INTERFACE_LINK_LIBRARIES "Threads::Threads;m")
endif()
set(dtrain_INCLUDE_DIR "${_dtrain_prefix}/include")
unset(_dtrain_prefix)
