// Cluster: the processes cooperating on one command.
//
// `mpirun -np N reshard convert ...` starts N copies of reshard; each joins
// the launcher's group and takes its share of the work by rank. Run plainly,
// reshard is a group of one and none of this costs anything.
//
// Every collective call (AllOk, Broadcast, AllGather) must be made by all ranks in the
// same order, from the thread that called Join.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "reshard/status.h"

namespace reshard {

class Cluster {
 public:
  // Joins the launcher's group when the environment says mpirun or srun
  // started us, else returns a group of one. Call it from main before any
  // thread starts, and keep the result until the command is done.
  static Result<std::unique_ptr<Cluster>> Join();

  // A group of one, whatever the environment says.
  static std::unique_ptr<Cluster> Local();

  // How many processes the environment says a launcher started: 1 without a
  // launcher. An error when a launcher variable holds no usable count.
  static Result<int> LaunchedSize();

  virtual ~Cluster();  // leaves the group
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  virtual int rank() const = 0;  // 0 .. size() - 1
  virtual int size() const = 0;

  // Each rank passes its own status; every rank gets back the first failure
  // in rank order, its message prefixed "rank N: " when the group has more
  // than one process, or Ok. No rank returns before all have called, so it
  // doubles as a barrier.
  virtual Status AllOk(const Status& mine) = 0;

  // Returns rank 0's `from_root` on every rank; other ranks' arguments are
  // ignored.
  virtual Result<std::string> Broadcast(const std::string& from_root) = 0;

  // Every rank gets every rank's `mine`, in rank order.
  virtual Result<std::vector<std::string>> AllGather(const std::string& mine) = 0;

 protected:
  Cluster() = default;
};

}  // namespace reshard
