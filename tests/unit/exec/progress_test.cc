#include "reshard/progress.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

Progress Halfway() {
  Progress p;
  p.done = 3;
  p.total = 8;
  p.bytes_done = 512 << 20;
  p.bytes = 1024 << 20;
  p.seconds = 4;
  return p;
}

TEST(ProgressTest, LineShowsCountsBytesRateAndTimeLeftAsMinutesSeconds) {
  EXPECT_EQ(Halfway().Line(), "3/8 files, 512.00 MiB of 1.00 GiB, 128.00 MiB/s, ETA 0:04");
}

TEST(ProgressTest, FinishedLineSaysHowLongItTook) {
  Progress p = Halfway();
  p.done = p.total;
  p.bytes_done = p.bytes;
  p.seconds = 75;
  EXPECT_EQ(p.Line(), "8/8 files, 1.00 GiB of 1.00 GiB, 13.65 MiB/s, done in 1:15");
}

TEST(ProgressTest, BytesBeyondThePlannedTotalNeverShowMoreThanTheTotalNorANegativeEta) {
  Progress p = Halfway();
  p.bytes_done = p.bytes + 4096;  // a job streamed more than it was sized at
  EXPECT_EQ(p.SecondsLeft(), 0.0);
  EXPECT_NE(p.Line().find("1.00 GiB of 1.00 GiB"), std::string::npos) << p.Line();
  EXPECT_NE(p.Line().find("ETA 0:00"), std::string::npos) << p.Line();
}

TEST(ProgressTest, NoEtaBeforeTheRateIsKnown) {
  Progress p = Halfway();
  p.seconds = 0.2;
  EXPECT_EQ(p.SecondsLeft(), std::nullopt);
  EXPECT_NE(p.Line().find("ETA -:--"), std::string::npos) << p.Line();
}

TEST(ProgressTest, BarFillsByBytes) {
  const std::string bar = Halfway().Bar(10);
  EXPECT_EQ(bar.substr(0, 18), "[#####     ]  50% ") << bar;
  Progress empty;
  EXPECT_EQ(empty.Bar(4).substr(0, 12), "[####] 100% ") << empty.Bar(4);
}

TEST(ProgressTest, MinutesSeconds) {
  EXPECT_EQ(MinutesSeconds(4.4), "0:04");
  EXPECT_EQ(MinutesSeconds(750), "12:30");
  EXPECT_EQ(MinutesSeconds(3723), "1:02:03");
  EXPECT_EQ(MinutesSeconds(-3), "0:00");
}

}  // namespace
}  // namespace reshard
