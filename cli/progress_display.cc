#include "progress_display.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace {

constexpr int kBarWidth = 30;
constexpr int kMinBarWidth = 10;  // narrower says too little: the words alone

// The terminal's width in columns (80 when it does not say).
int TerminalColumns() {
  struct winsize size {};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  return 80;
}

}  // namespace

ProgressDisplay::ProgressDisplay(bool terminal, double log_interval)
    : terminal_(terminal), log_interval_(log_interval) {}

ProgressDisplay::~ProgressDisplay() { Finish(); }

reshard::ProgressCallback ProgressDisplay::Callback() {
  return [this](const reshard::Progress& progress) { Show(progress); };
}

void ProgressDisplay::Show(const reshard::Progress& progress) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!terminal_) {
    // A run shorter than the interval logs nothing (its summary says it all);
    // a longer one logs its end too.
    const bool due = progress.seconds - logged_at_ >= log_interval_;
    if (!due && !(progress.finished() && logged_at_ > 0)) return;
    logged_at_ = progress.seconds;
    std::fprintf(stderr, "%s\n", progress.Line().c_str());
    return;
  }
  // The last column stays free: a line that fills it wraps on some terminals.
  const int columns = TerminalColumns() - 1;
  std::string line = progress.Line();
  // The bar takes what the words leave, up to kBarWidth ("[", "] ", "100% ": 8 more).
  const int room = columns - static_cast<int>(line.size()) - 8;
  if (room >= kMinBarWidth) line = progress.Bar(std::min(room, kBarWidth));
  if (static_cast<int>(line.size()) > columns) line.resize(static_cast<size_t>(std::max(columns, 0)));
  std::fprintf(stderr, "\r%s\033[K", line.c_str());  // \033[K: clear what a longer line left
  std::fflush(stderr);
  line_open_ = true;
}

void ProgressDisplay::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!line_open_) return;
  std::fputc('\n', stderr);
  line_open_ = false;
}
