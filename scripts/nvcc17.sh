#!/bin/sh
# nvcc wrapper for building Horovod 0.28.1 against CUDA 13 (scripts/install.sh --gpu sets
# it as CUDACXX, the real nvcc in HVD_COMPRESS_REAL_NVCC).
#
# Horovod's CMake compiles its CUDA kernels with -std=c++11 (CMAKE_CUDA_STANDARD 11); CUDA
# 13's headers need C++17, and nvcc refuses a second -std, so -std=c++11 is replaced.
for arg do
  shift
  case "$arg" in
    -std=c++11) set -- "$@" -std=c++17 ;;
    *) set -- "$@" "$arg" ;;
  esac
done
exec "${HVD_COMPRESS_REAL_NVCC:?HVD_COMPRESS_REAL_NVCC: the real nvcc}" "$@"
