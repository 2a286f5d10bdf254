#include "cluster/mpi_cluster.h"

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace reshard {
namespace {

// MPI calls keep MPI's default error handler, which aborts the whole job:
// a collective that failed on one rank leaves the others waiting in it, so
// an error returned to the caller would only turn into a hang.

class MpiCluster : public Cluster {
 public:
  MpiCluster() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  ~MpiCluster() override { MPI_Finalize(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status AllOk(const Status& mine) override;
  Result<std::string> Broadcast(const std::string& from_root) override;
  Result<std::vector<std::string>> AllGather(const std::string& mine) override;

 private:
  // Replaces `*s` on every rank with its value on `root`.
  void BroadcastFrom(int root, std::string* s);

  int rank_ = 0;
  int size_ = 1;
};

// The Status a peer described by its code and message.
Status Rebuild(int code, std::string message) {
  switch (static_cast<Status::Code>(code)) {
    case Status::Code::kOk: return Status::Ok();
    case Status::Code::kInvalidInput: return Status::InvalidInput(std::move(message));
    case Status::Code::kRuleError: return Status::RuleError(std::move(message));
    case Status::Code::kUnsupported: return Status::Unsupported(std::move(message));
    case Status::Code::kIoError: return Status::IoError(std::move(message));
    case Status::Code::kInternal: break;
  }
  return Status::Internal(std::move(message));
}

Status MpiCluster::AllOk(const Status& mine) {
  // Every rank learns every code; only the first failure's message travels.
  const int code = static_cast<int>(mine.code());
  std::vector<int> codes(size_);
  MPI_Allgather(&code, 1, MPI_INT, codes.data(), 1, MPI_INT, MPI_COMM_WORLD);
  const auto failed = std::find_if(codes.begin(), codes.end(), [](int c) { return c != 0; });
  if (failed == codes.end()) return Status::Ok();
  const int root = static_cast<int>(failed - codes.begin());
  std::string message = mine.message();
  BroadcastFrom(root, &message);
  return Rebuild(*failed, std::move(message)).WithContext("rank " + std::to_string(root));
}

Result<std::string> MpiCluster::Broadcast(const std::string& from_root) {
  std::string s = rank_ == 0 ? from_root : std::string();
  BroadcastFrom(0, &s);
  return s;
}

Result<std::vector<std::string>> MpiCluster::AllGather(const std::string& mine) {
  // One broadcast per rank: the strings are reports, small beside the work.
  std::vector<std::string> all(size_);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) all[r] = mine;
    BroadcastFrom(r, &all[r]);
  }
  return all;
}

void MpiCluster::BroadcastFrom(int root, std::string* s) {
  // The length first, then the bytes in pieces that fit MPI's int counts.
  constexpr uint64_t kPiece = 1u << 30;
  uint64_t n = s->size();
  MPI_Bcast(&n, 1, MPI_UINT64_T, root, MPI_COMM_WORLD);
  s->resize(n);
  for (uint64_t done = 0; done < n; done += kPiece) {
    const int count = static_cast<int>(std::min(kPiece, n - done));
    MPI_Bcast(s->data() + done, count, MPI_BYTE, root, MPI_COMM_WORLD);
  }
}

// "Open MPI v4.1.4": the library's name without the build details after it.
std::string LibraryName() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(version, &length);
  std::string name(version, length);
  return name.substr(0, name.find_first_of(",\n"));
}

// Open MPI picks its point-to-point layer by trying each in turn, and the
// network ones probe their devices: UCX's probe alone cost 0.2 s of a 0.3 s
// MPI_Init on a single machine. When Open MPI's launcher says every process
// runs on this node, shared memory is all there is to use, so ob1 (over
// shared memory) is asked for unless the user chose a layer.
void PreferSharedMemoryOnOneNode() {
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (size == nullptr || local == nullptr || std::string(size) != local) return;
  ::setenv("OMPI_MCA_pml", "ob1", /*overwrite=*/0);
}

}  // namespace

Result<std::unique_ptr<Cluster>> JoinMpi(int launched_size) {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized || finalized) return Status::Internal("Cluster::Join called twice");

  PreferSharedMemoryOnOneNode();
  // FUNNELED: reshard's worker threads never call MPI, only the main thread.
  int provided = 0;
  if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
    return Status::Internal("MPI_Init_thread failed");
  }
  auto cluster = std::make_unique<MpiCluster>();  // from here on, returning finalizes MPI
  if (provided < MPI_THREAD_FUNNELED) {
    return Status::Unsupported(LibraryName() + " does not allow a threaded process "
                               "(MPI_THREAD_FUNNELED); run reshard without the launcher");
  }
  if (cluster->size() != launched_size) {
    return Status::Unsupported(
        "the launcher started " + std::to_string(launched_size) + " processes but " +
        LibraryName() + " sees a group of " + std::to_string(cluster->size()) +
        "; start reshard with the mpirun of the MPI it was built with (for srun, add "
        "--mpi=pmix)");
  }
  return std::unique_ptr<Cluster>(std::move(cluster));
}

}  // namespace reshard
