// reshard::CleanUpOnSignals: an interrupted run removes its staging folders
// and says which output was not written.
//
// The signals are blocked in every thread and taken by one thread with
// sigwait, where removing folders is ordinary code (a signal handler could
// do almost nothing safely); then the signal is raised again with its
// default action, so the process still dies of it.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>

#include <thread>

#include "container/mapped_file.h"
#include "exec/output_folder.h"
#include "reshard/reshard.h"

namespace reshard {

void CleanUpOnSignals() {
  ReportBusErrorsOnMappedFiles();
  // Writes past RLIMIT_FSIZE then fail with EFBIG, reported like any I/O error.
  ::signal(SIGXFSZ, SIG_IGN);
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
  ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    int sig = 0;
    if (::sigwait(&set, &sig) != 0) return;
    for (const std::string& out : RemoveStagingFolders()) {
      // The progress line on a terminal is still open: end it first.
      std::fprintf(stderr, "%sreshard: interrupted: nothing was written to %s (its partial files were removed); "
                   "run the command again to write it\n", ::isatty(STDERR_FILENO) == 1 ? "\n" : "", out.c_str());
    }
    ::signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    ::pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    ::raise(sig);
  }).detach();
}

}  // namespace reshard
