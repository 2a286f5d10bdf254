#include "reshard/cluster.h"

#include <cerrno>
#include <climits>
#include <cstdlib>

#ifdef RESHARD_WITH_MPI
#include "cluster/mpi_cluster.h"
#endif

namespace reshard {
namespace {

class LocalCluster : public Cluster {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Status AllOk(const Status& mine) override { return mine; }
  Result<std::string> Broadcast(const std::string& from_root) override { return from_root; }
  Result<std::vector<std::string>> AllGather(const std::string& mine) override {
    return std::vector<std::string>{mine};
  }
  // Alone, rank 0 has no one to hear from.
  Status CanPostFromAnyThread() const override { return Status::Ok(); }
  bool Post(const std::string&, bool) override { return false; }
  std::vector<std::pair<int, std::string>> Received() override { return {}; }
};

// Variables in which launchers announce how many processes they started.
// Not SLURM_NTASKS: a batch script sees it too, and there nothing launched
// us, so MPI_Init would start a runtime of its own.
constexpr const char* kSizeVariables[] = {
    "OMPI_COMM_WORLD_SIZE",  // Open MPI's mpirun
    "PMI_SIZE",              // MPICH and Intel MPI (Hydra), srun --mpi=pmi2
    "SLURM_STEP_NUM_TASKS",  // srun
};

}  // namespace

Cluster::~Cluster() = default;

std::unique_ptr<Cluster> Cluster::Local() { return std::make_unique<LocalCluster>(); }

Result<int> Cluster::LaunchedSize() {
  for (const char* name : kSizeVariables) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    errno = 0;
    char* end = nullptr;
    const long n = std::strtol(value, &end, 10);
    if (errno != 0 || *end != '\0' || n < 1 || n > INT_MAX) {
      return Status::InvalidInput(std::string(name) + "='" + value +
                                  "' is not a process count; was reshard started by a launcher?");
    }
    return static_cast<int>(n);
  }
  return 1;
}

Result<std::unique_ptr<Cluster>> Cluster::Join() {
  RESHARD_ASSIGN_OR_RETURN(const int launched, LaunchedSize());
  // A launcher's group of one needs no MPI either.
  if (launched == 1) return Local();
#ifdef RESHARD_WITH_MPI
  return JoinMpi(launched);
#else
  return Status::Unsupported(
      "reshard was built without MPI; it cannot be one of the " + std::to_string(launched) +
      " processes mpirun or srun started. Run it without the launcher, or rebuild it with MPI "
      "installed (Debian: libopenmpi-dev)");
#endif
}

}  // namespace reshard
