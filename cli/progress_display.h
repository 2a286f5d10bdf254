// ProgressDisplay: shows a command's progress on stderr.
//
// On a terminal, one line redrawn in place (a bar, bytes, rate, time left),
// cut to the terminal's width so that it never wraps; otherwise (a log
// file, a pipe, any rank under mpirun) a line every few seconds and the last
// one, so that logs stay short but still show that work goes on; a run done
// within those seconds logs none.
#pragma once

#include <mutex>

#include "reshard/progress.h"

class ProgressDisplay {
 public:
  // Seconds between two lines when stderr is no terminal, unless told otherwise.
  static constexpr double kLogInterval = 5.0;

  // `terminal`: whether stderr is one (isatty). `log_interval`: seconds
  // between two lines when it is not.
  ProgressDisplay(bool terminal, double log_interval);
  ~ProgressDisplay();  // calls Finish()

  ProgressDisplay(const ProgressDisplay&) = delete;
  ProgressDisplay& operator=(const ProgressDisplay&) = delete;

  // What the engine calls; valid while this display lives.
  reshard::ProgressCallback Callback();
  // Ends a redrawn line, so that what is printed next starts a line of its own.
  void Finish();

 private:
  void Show(const reshard::Progress& progress);

  const bool terminal_;
  const double log_interval_;
  std::mutex mu_;
  bool line_open_ = false;  // a redrawn line waits for its end
  double logged_at_ = 0;  // when the last line was logged (0: none yet)
};
