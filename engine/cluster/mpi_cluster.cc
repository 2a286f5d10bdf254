#include "cluster/mpi_cluster.h"

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace reshard {
namespace {

// "Open MPI v4.1.4": the library's name without the build details after it.
std::string LibraryName() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(version, &length);
  std::string name(version, length);
  return name.substr(0, name.find_first_of(",\n"));
}

// MPI calls keep MPI's default error handler, which aborts the whole job:
// a collective that failed on one rank leaves the others waiting in it, so
// an error returned to the caller would only turn into a hang.

// What posts are sent with (the collectives' messages never meet them).
constexpr int kPostTag = 1;

class MpiCluster : public Cluster {
 public:
  // `thread_level`: what MPI_Init_thread provided.
  explicit MpiCluster(int thread_level) : thread_level_(thread_level) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  ~MpiCluster() override { MPI_Finalize(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status AllOk(const Status& mine) override;
  Result<std::string> Broadcast(const std::string& from_root) override;
  Result<std::vector<std::string>> AllGather(const std::string& mine) override;
  Status CanPostFromAnyThread() const override;
  bool Post(const std::string& message, bool wait) override;
  std::vector<std::pair<int, std::string>> Received() override;

 private:
  // Replaces `*s` on every rank with its value on `root`.
  void BroadcastFrom(int root, std::string* s);

  const int thread_level_;
  int rank_ = 0;
  int size_ = 1;
  std::mutex posts_mu_;  // MPI_THREAD_SERIALIZED: one thread in MPI at a time
  MPI_Request sending_ = MPI_REQUEST_NULL;  // the post on its way
  std::string sent_;  // its bytes, which MPI reads until it is sent
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

Status MpiCluster::CanPostFromAnyThread() const {
  if (thread_level_ >= MPI_THREAD_SERIALIZED) return Status::Ok();
  return Status::Unsupported(LibraryName() + " lets only the main thread call MPI "
                             "(it does not provide MPI_THREAD_SERIALIZED)");
}

bool MpiCluster::Post(const std::string& message, bool wait) {
  std::lock_guard<std::mutex> lock(posts_mu_);
  if (wait) {
    MPI_Wait(&sending_, MPI_STATUS_IGNORE);
  } else {
    int sent = 1;
    MPI_Test(&sending_, &sent, MPI_STATUS_IGNORE);  // sets sending_ to MPI_REQUEST_NULL once sent
    if (!sent) return false;
  }
  sent_ = message;
  MPI_Isend(sent_.data(), static_cast<int>(sent_.size()), MPI_BYTE, 0, kPostTag, MPI_COMM_WORLD, &sending_);
  if (wait) MPI_Wait(&sending_, MPI_STATUS_IGNORE);
  return true;
}

std::vector<std::pair<int, std::string>> MpiCluster::Received() {
  std::lock_guard<std::mutex> lock(posts_mu_);
  std::vector<std::pair<int, std::string>> posts;
  for (;;) {
    int arrived = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, kPostTag, MPI_COMM_WORLD, &arrived, &status);
    if (!arrived) return posts;
    int length = 0;
    MPI_Get_count(&status, MPI_BYTE, &length);
    std::string message(static_cast<size_t>(length), '\0');
    MPI_Recv(message.data(), length, MPI_BYTE, status.MPI_SOURCE, kPostTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    posts.emplace_back(status.MPI_SOURCE, std::move(message));
  }
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
  // The collectives need FUNNELED (only the main thread calls them); posts
  // come from worker threads, one at a time, which SERIALIZED allows. A
  // library that provides less is asked for no more than it gives: then only
  // the posts are off (CanPostFromAnyThread).
  int provided = 0;
  if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
    return Status::Internal("MPI_Init_thread failed");
  }
  auto cluster = std::make_unique<MpiCluster>(provided);  // from here on, returning finalizes MPI
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
