"""CPU kernels in C + OpenMP (kernels/cpu/*.c), built by `make kernels` into kernels/cpu/build/ and
loaded with ctypes over tensor data pointers; without the built library the torch references run."""
