#pragma once
// The CUDA executor of byte runs: one kernel over a run table and its work items
// (kvlayout/run_plan.h; the host splits runs into items, the tests walk the same mapping).

#include <cstdint>

#include "kvlayout/run_plan.h"

namespace kvlayout::cuda {

// Launches the copy of `runs` (device, num_runs) through `items` (device, num_items, from
// runs::plan_items) on `stream`, on the current device. Returns the cudaError_t of the
// launch as an int (0 = success).
int launch_copy_runs(const runs::Run* runs, const runs::Item* items, std::uint32_t num_items, void* stream);

// Loads the run kernel into the current device's context now (see load_transfer_kernels).
// Returns a cudaError_t as an int.
int load_run_kernel();

}  // namespace kvlayout::cuda
