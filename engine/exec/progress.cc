#include "reshard/progress.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "util/human.h"

namespace reshard {

double Progress::Rate() const { return seconds >= 1.0 ? static_cast<double>(bytes_done) / seconds : 0; }

std::optional<double> Progress::SecondsLeft() const {
  if (finished()) return 0.0;
  const double rate = Rate();
  if (rate <= 0) return std::nullopt;
  // A job may stream a little more than it was sized at (headers): never below zero.
  return std::max<int64_t>(0, bytes - bytes_done) / rate;
}

std::string Progress::Line() const {
  // Counts are capped at their totals so the line never reads "47/46".
  std::string line = std::to_string(std::min(done, total)) + "/" + std::to_string(total) + " " + unit + ", " +
                     HumanBytes(std::min(bytes_done, bytes)) + " of " + HumanBytes(bytes);
  if (const double rate = Rate(); rate > 0) line += ", " + HumanBytes(static_cast<int64_t>(rate)) + "/s";
  if (finished()) return line + ", done in " + MinutesSeconds(seconds);
  const std::optional<double> left = SecondsLeft();
  return line + ", ETA " + (left ? MinutesSeconds(*left) : std::string("-:--"));
}

std::string Progress::Bar(int width) const {
  // By bytes where there are any (files differ in size), else by count.
  const double fraction = bytes > 0 ? static_cast<double>(bytes_done) / bytes
                                    : total > 0 ? static_cast<double>(done) / total : 1.0;
  const double shown = std::clamp(finished() ? 1.0 : fraction, 0.0, 1.0);
  const int filled = static_cast<int>(shown * width);
  char percent[8];
  std::snprintf(percent, sizeof(percent), "%3d%%", static_cast<int>(shown * 100));
  return "[" + std::string(filled, '#') + std::string(width - filled, ' ') + "] " + percent + " " + Line();
}

std::string MinutesSeconds(double seconds) {
  const int64_t s = std::max<int64_t>(0, std::llround(seconds));
  char text[32];
  if (s >= 3600) {
    std::snprintf(text, sizeof(text), "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(text, sizeof(text), "%lld:%02lld", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  }
  return text;
}

}  // namespace reshard
