// What distmuon-bench records about the CUDA device a rank runs on, through the runtime (the tool
// links no driver library, so that it starts on machines without a GPU). Without CUDA in the
// build the functions return 0 / nullptr.
#pragma once

namespace distmuon::bench {

// The calling thread's current CUDA context (a CUcontext): what a profiler names a process's
// kernels by.
void* current_context();
// The multiprocessors the calling process may use on CUDA device `device`: under CUDA MPS with
// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE the client's share, else the device's.
int device_sm_count(int device);

}  // namespace distmuon::bench
