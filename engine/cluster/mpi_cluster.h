// The MPI side of Cluster, declared apart from cluster.h so that only
// mpi_cluster.cc sees <mpi.h>. It exists only in builds where CMake found MPI
// (RESHARD_WITH_MPI).
#pragma once

#include <memory>

#include "reshard/cluster.h"
#include "reshard/status.h"

namespace reshard {

// Initialises MPI and joins MPI_COMM_WORLD. `launched_size` is the process
// count the launcher announced; MPI seeing another size means the launcher
// and the MPI library reshard was built with do not belong together.
Result<std::unique_ptr<Cluster>> JoinMpi(int launched_size);

}  // namespace reshard
