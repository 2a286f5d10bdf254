#include "api/common.h"

#include <sched.h>

#include <algorithm>
#include <thread>

namespace reshard {

int ThreadCount(int requested) {
  if (requested > 0) return requested;
  // The cores this process may run on: mpirun binds each rank to its own.
  cpu_set_t cpus;
  if (::sched_getaffinity(0, sizeof(cpus), &cpus) == 0) return std::max(1, CPU_COUNT(&cpus));
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace reshard
