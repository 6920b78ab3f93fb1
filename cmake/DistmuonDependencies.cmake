# Third-party dependencies. Every one comes from the system (Debian packages installed by
# `make deps`); nothing is downloaded at configure time.

find_package(Threads REQUIRED)

# BLAS for the CPU backend: OpenBLAS (multithreaded) through its CBLAS interface.
find_path(OPENBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas x86_64-linux-gnu/openblas-pthread)
find_library(OPENBLAS_LIBRARY NAMES openblas)
if(NOT OPENBLAS_LIBRARY OR NOT OPENBLAS_INCLUDE_DIR)
  message(FATAL_ERROR "OpenBLAS not found: run `make deps` (apt-get install libopenblas-dev)")
endif()
add_library(distmuon_blas INTERFACE)
target_include_directories(distmuon_blas INTERFACE ${OPENBLAS_INCLUDE_DIR})
target_link_libraries(distmuon_blas INTERFACE ${OPENBLAS_LIBRARY})

find_package(nlohmann_json 3 REQUIRED)

# CLI11 for the command lines of the tools (header-only).
if(DISTMUON_BUILD_TOOLS)
  find_package(CLI11 2 CONFIG)
  if(NOT CLI11_FOUND)
    message(FATAL_ERROR "CLI11 not found: run `make deps` (apt-get install libcli11-dev)")
  endif()
endif()

# COIN-OR CBC for the planner's MILP.
find_package(PkgConfig REQUIRED)
pkg_check_modules(CBC REQUIRED IMPORTED_TARGET cbc)

if(DISTMUON_WITH_MPI)
  find_package(MPI COMPONENTS C)
  if(NOT MPI_C_FOUND)
    message(WARNING "MPI not found: the MPI communicator and MPI tests are disabled")
    set(DISTMUON_WITH_MPI OFF)
  endif()
endif()

set(DISTMUON_HAVE_CUDA OFF)
if(DISTMUON_WITH_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # sm_90a: wgmma and the tensor memory accelerator of Hopper.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90a)
    endif()
    enable_language(CUDA)
    # CMake < 3.26 does not know nvcc's C++20 flag; nvcc 12+ accepts it.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    find_package(CUDAToolkit REQUIRED)
    set(DISTMUON_HAVE_CUDA ON)
    message(STATUS "distmuon: CUDA backend enabled (${CMAKE_CUDA_COMPILER_VERSION}, arch ${CMAKE_CUDA_ARCHITECTURES})")
  else()
    message(STATUS "distmuon: nvcc not found, CUDA backend disabled")
  endif()
endif()

# NCCL for the GPU communicator: NCCL_ROOT when set, else the nvidia-nccl wheel of the Python
# environment (the copy torch loads, and the one distmuon/_cuda_libs.py loads at import, so the
# headers match the library that runs), else the CUDA toolkit's copy.
set(DISTMUON_HAVE_NCCL OFF)
if(DISTMUON_HAVE_CUDA)
  set(_nccl_hints $ENV{NCCL_ROOT} ${NCCL_ROOT})
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])"
      OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_nccl_wheel)
      list(APPEND _nccl_hints ${_nccl_wheel})
    endif()
  endif()
  list(APPEND _nccl_hints ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
            PATH_SUFFIXES include)
  # NAMES_PER_DIR: the wheel has only libnccl.so.2, which must win over a toolkit's libnccl.so.
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
               HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(DISTMUON_HAVE_NCCL ON)
    message(STATUS "distmuon: NCCL communicator enabled (${NCCL_LIBRARY})")
  else()
    message(STATUS "distmuon: NCCL not found (set NCCL_ROOT), NCCL communicator disabled")
  endif()
endif()
