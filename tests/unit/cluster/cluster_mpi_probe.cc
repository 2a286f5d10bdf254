// Run as `mpirun -np 2 cluster_mpi_probe` (CTest: cluster.mpirun_np2). Checks
// that Cluster joins the launcher's group, broadcasts rank 0's string,
// gathers every rank's string, carries rank 1's failure to every rank, and
// brings rank 1's posts to rank 0 in order. Each rank prints one line; any
// mismatch makes it exit 1.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "reshard/cluster.h"

namespace {

using reshard::Cluster;
using reshard::Status;

// Rank 1 posts twice, from another thread, the second time waiting until it
// is sent; rank 0 takes both, in order, without a call to match them.
std::string CheckPosts(Cluster& cluster) {
  const Status can = cluster.CanPostFromAnyThread();
  if (!can.ok()) return "CanPostFromAnyThread: " + can.message();  // Open MPI gives SERIALIZED
  if (cluster.rank() == 1) {
    std::thread([&cluster] { cluster.Post("first", /*wait=*/true); }).join();
    cluster.Post("second", /*wait=*/true);
    return "";
  }
  std::vector<std::string> got;
  while (got.size() < 2) {
    for (const auto& [rank, post] : cluster.Received()) {
      if (rank != 1) return "a post from rank " + std::to_string(rank);
      got.push_back(post);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (got != std::vector<std::string>{"first", "second"}) return "the posts came as '" + got[0] + "', '" + got[1] + "'";
  return "";
}

// Empty when every check passed, else what went wrong.
std::string Check(Cluster& cluster) {
  if (cluster.size() != 2) return "size " + std::to_string(cluster.size()) + ", want 2";

  const std::string sent = cluster.rank() == 0 ? "from rank 0" : "not this";
  reshard::Result<std::string> got = cluster.Broadcast(sent);
  if (!got.ok()) return "Broadcast: " + got.status().message();
  if (*got != "from rank 0") return "Broadcast gave '" + *got + "'";

  reshard::Result<std::vector<std::string>> gathered =
      cluster.AllGather("rank " + std::to_string(cluster.rank()));
  if (!gathered.ok()) return "AllGather: " + gathered.status().message();
  if (*gathered != std::vector<std::string>{"rank 0", "rank 1"}) return "AllGather gave other strings";

  Status all = cluster.AllOk(Status::Ok());
  if (!all.ok()) return "AllOk of two Oks: " + all.message();

  // Rank 1 fails; rank 0's own status is Ok, so it must learn of it from rank 1.
  const Status mine = cluster.rank() == 1 ? Status::IoError("disk full") : Status::Ok();
  all = cluster.AllOk(mine);
  if (all.code() != Status::Code::kIoError || all.message() != "rank 1: disk full") {
    return "AllOk gave '" + all.message() + "'";
  }
  return CheckPosts(cluster);
}

}  // namespace

int main() {
  reshard::Result<std::unique_ptr<Cluster>> cluster = Cluster::Join();
  if (!cluster.ok()) {
    std::printf("cluster_mpi_probe: Join: %s\n", cluster.status().message().c_str());
    return 1;
  }
  const std::string problem = Check(**cluster);
  std::printf("cluster_mpi_probe: rank %d of %d: %s\n", (*cluster)->rank(), (*cluster)->size(),
              problem.empty() ? "ok" : problem.c_str());
  return problem.empty() ? 0 : 1;
}
