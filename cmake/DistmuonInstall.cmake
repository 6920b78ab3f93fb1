# Install rules of the C++ library: headers, the static library, the command-line tools and a
# CMake package, so that another project can use
#
#   find_package(distmuon CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE distmuon::distmuon)
#
# The package re-finds the dependencies the static library links (OpenMP, CBC and the CUDA
# toolkit where the build had it). tests/consumer builds such a project against an install.
# The Python wheel sets DISTMUON_INSTALL=OFF: it ships only distmuon._C.

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DISTMUON_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/distmuon)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/distmuon DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS distmuon distmuon_blas EXPORT distmuonTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(DISTMUON_BUILD_TOOLS)
  install(TARGETS distmuon-bench distmuon-plan RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT distmuonTargets NAMESPACE distmuon:: DESTINATION ${DISTMUON_CMAKE_DIR})

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/distmuonConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/distmuonConfig.cmake INSTALL_DESTINATION ${DISTMUON_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/distmuonConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/distmuonConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/distmuonConfigVersion.cmake
        DESTINATION ${DISTMUON_CMAKE_DIR})
