// distmuon-bench --mode gather,replicated,sharded,dedicated: the distributed modes timed side by
// side in one run under mpirun (bench_dist.cc).
#pragma once

#include "cli.h"

namespace distmuon::bench {

// Declares the options of the distributed comparison.
void declare_distributed_options(cli::Args& args);
// True when --mode names distributed modes (anything but "single").
bool wants_distributed(const cli::Args& args);
// Runs the comparison; only rank 0 prints and writes the JSON. Returns the exit code.
int run_distributed(const cli::Args& args);

}  // namespace distmuon::bench
