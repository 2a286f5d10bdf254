// Cluster: the processes cooperating on one command.
//
// `mpirun -np N reshard convert ...` starts N copies of reshard; each joins
// the launcher's group and takes its share of the work by rank. Run plainly,
// reshard is a group of one and none of this costs anything.
//
// Every collective call (AllOk, Broadcast, AllGather) must be made by all ranks in the
// same order, from the thread that called Join. Posts (Post, Received) go from
// the other ranks to rank 0 alone, with no call to match on the other side:
// how far each rank has got, while the ranks work on their own.
#pragma once

#include <memory>
#include <string>
#include <utility>
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

  // Ok when posts may be made from any thread (one call at a time, and none
  // during a collective); else why not: the MPI library lets only the thread
  // that called Join call it.
  virtual Status CanPostFromAnyThread() const = 0;

  // From a rank other than 0: sends `message` to rank 0 without waiting. While
  // the previous post is still on its way, `message` is dropped (posts never
  // pile up) and false returned, unless `wait`: then it waits for the
  // previous one, and for this one to be sent.
  virtual bool Post(const std::string& message, bool wait) = 0;

  // On rank 0: the posts that arrived since the last call, with the rank
  // that sent each, in the order they arrived; never waits.
  virtual std::vector<std::pair<int, std::string>> Received() = 0;

 protected:
  Cluster() = default;
};

}  // namespace reshard
