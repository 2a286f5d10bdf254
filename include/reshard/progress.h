// reshard::Progress: where a long command stands, as its progress callback
// receives it (about once a second, and once more when the last item is done).
//
// The front ends decide how to show it: the CLI redraws Bar() in place on a
// terminal and prints Line() every few seconds otherwise; the Python module
// hands Line() to the user's callback.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace reshard {

struct Progress {
  std::string unit = "files";  // what `done` and `total` count: "files", "tensors"
  int64_t done = 0;
  int64_t total = 0;
  int64_t bytes_done = 0;
  int64_t bytes = 0;
  double seconds = 0;  // since the work began

  bool finished() const { return done >= total; }
  // Bytes per second so far (0 before the first second).
  double Rate() const;
  // Seconds left at the rate so far; none before the rate is known.
  std::optional<double> SecondsLeft() const;
  // "12/46 files, 610 MiB of 1.36 GiB, 210 MiB/s, ETA 0:04"
  std::string Line() const;
  // "[#######             ]  27% " + Line(): `width` characters between the brackets.
  std::string Bar(int width = 24) const;
};

// Called from worker threads, one call at a time.
using ProgressCallback = std::function<void(const Progress&)>;

// "0:04", "12:30", "1:02:03"
std::string MinutesSeconds(double seconds);

}  // namespace reshard
