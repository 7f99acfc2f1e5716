#pragma once
// KVLAYOUT_HOST_DEVICE marks functions callable from host code and CUDA device code;
// without a CUDA compiler it expands to nothing, so the headers are plain C++17.

#if defined(__CUDACC__)
#define KVLAYOUT_HOST_DEVICE __host__ __device__
#else
#define KVLAYOUT_HOST_DEVICE
#endif
