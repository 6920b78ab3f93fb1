// distmuon-bench --mode gather,replicated,sharded,dedicated: the distributed modes timed side by
// side in one run under mpirun (bench_dist.cc).
#pragma once

#include "bench_options.h"

namespace distmuon::bench {

// Runs the comparison; only rank 0 prints and writes the JSON. Returns the exit code.
int run_distributed(const BenchOptions& o);

}  // namespace distmuon::bench
