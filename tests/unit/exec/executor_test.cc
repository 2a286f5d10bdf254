#include "exec/executor.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace reshard {
namespace {

// A job that streams `bytes` in one report.
Job Streaming(const std::string& name, int64_t bytes, int part = 0) {
  Job job;
  job.name = name;
  job.bytes = bytes;
  job.part = part;
  job.run = [bytes](JobContext& ctx) {
    ctx.done(bytes);
    return Status::Ok();
  };
  return job;
}

// One big file in three parts (which the ranks share) and small whole files.
std::vector<Job> Plan() {
  return {Streaming("big", 400, 0), Streaming("big", 400, 1), Streaming("big", 400, 2),
          Streaming("a", 100),      Streaming("b", 90),       Streaming("c", 80)};
}

TEST(JobsOfRankTest, EveryItemIsCountedByExactlyOneRank) {
  std::multiset<std::string> counted;
  int64_t total = 0, bytes = 0;
  std::set<int> ranks_of_big;
  for (int rank = 0; rank < 3; ++rank) {
    const std::vector<Job> mine = JobsOfRank(Plan(), rank, 3);
    for (const Job& job : mine) {
      if (job.name == "big") ranks_of_big.insert(rank);
      if (job.counts_item) counted.insert(job.name);
    }
    const Progress before = ProgressBefore(mine, "files");
    total += before.total;
    bytes += before.bytes;
  }
  EXPECT_EQ(ranks_of_big.size(), 3u);  // the big file's parts are shared
  EXPECT_EQ(counted, (std::multiset<std::string>{"a", "b", "c", "big"}));
  EXPECT_EQ(total, 4);  // the ranks' totals add up to the whole job's items
  EXPECT_EQ(bytes, JobBytes(Plan()));
}

TEST(JobsOfRankTest, AloneEveryJobCountsItsItem) {
  const std::vector<Job> all = JobsOfRank(Plan(), 0, 1);
  ASSERT_EQ(all.size(), 6u);
  for (const Job& job : all) EXPECT_TRUE(job.counts_item) << job.name << " part " << job.part;
  EXPECT_EQ(ProgressBefore(all, "files").total, 4);
}

TEST(ExecuteTest, ReportsOnceWhenTheLastJobIsDoneEvenIfItCountsNoItem) {
  // Rank 1 of 2 writes a file of its own, then a part of "big" that rank 0
  // counts, in many small steps after its only item is done.
  std::vector<Job> mine = {Streaming("a", 100), Streaming("big", 400, 1)};
  mine[1].counts_item = false;
  mine[1].run = [](JobContext& ctx) {
    for (int i = 0; i < 400; ++i) ctx.done(1);
    return Status::Ok();
  };
  std::vector<Progress> reports;
  ExecuteOptions options;
  options.threads = 1;
  options.progress = [&](const Progress& p) { reports.push_back(p); };
  ASSERT_TRUE(Execute(mine, options).ok());
  // Reports come about once a second and at the end, not at every step.
  ASSERT_GE(reports.size(), 1u);
  EXPECT_LE(reports.size(), 3u);
  const Progress& last = reports.back();
  EXPECT_EQ(last.done, 1);
  EXPECT_EQ(last.total, 1);
  EXPECT_EQ(last.bytes_done, 500);
  EXPECT_EQ(last.bytes, 500);
}

}  // namespace
}  // namespace reshard
