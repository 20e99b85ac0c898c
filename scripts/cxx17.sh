#!/bin/sh
# C++ compiler wrapper for building Horovod 0.28.1 against torch 2.x and TensorFlow 2.21.
#
# Horovod's CMakeLists forces -std=c++14 after every user flag; torch 2.x headers need
# C++17, so the standard is appended as the *last* argument, where it wins.
# horovod/tensorflow/xla_mpi_ops.cc includes XLA headers that TensorFlow has moved; the
# file is guarded by TENSORFLOW_VERSION and compiles empty below 2.6, so it alone is
# compiled with that macro lowered (Horovod's optional XLA ops are then absent).
case "$*" in
  *xla_mpi_ops.cc*) exec "${HVD_COMPRESS_REAL_CXX:-g++}" "$@" -UTENSORFLOW_VERSION -DTENSORFLOW_VERSION=2005000000 -std=c++17 ;;
  *) exec "${HVD_COMPRESS_REAL_CXX:-g++}" "$@" -std=c++17 ;;
esac
