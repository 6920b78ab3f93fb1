# The one place the version is written: CMakeLists.txt (the C++ library, its CMake package and
# distmuon._C) and pyproject.toml (the wheel's metadata) both read it from here.
__version__ = "0.1.0"
