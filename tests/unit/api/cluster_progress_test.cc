#include "api/cluster_progress.h"

#include <gtest/gtest.h>

#include <deque>
#include <string>
#include <utility>
#include <vector>

namespace reshard {
namespace {

Progress Before(int64_t total, int64_t bytes) {
  Progress p;
  p.total = total;
  p.bytes = bytes;
  return p;
}

Progress Counts(int64_t done, int64_t bytes_done) {
  Progress p;
  p.done = done;
  p.bytes_done = bytes_done;
  return p;
}

TEST(ProgressSumTest, AddsEveryRanksLatestCountsAndTotals) {
  ProgressSum sum({Before(2, 200), Before(3, 300)});
  sum.Take(1, ProgressSum::Post(Counts(1, 50), false));
  sum.Take(1, ProgressSum::Post(Counts(2, 120), false));  // the latest replaces the one before
  sum.Take(0, ProgressSum::Post(Counts(1, 80), false));
  const Progress whole = sum.Sum(3.0);
  EXPECT_EQ(whole.done, 3);
  EXPECT_EQ(whole.total, 5);
  EXPECT_EQ(whole.bytes_done, 200);
  EXPECT_EQ(whole.bytes, 500);
  EXPECT_EQ(whole.seconds, 3.0);
  EXPECT_EQ(whole.unit, "files");
}

TEST(ProgressSumTest, IsNotFinishedUntilEveryRanksLastCountsAreIn) {
  // Every item counted done, as when the rank writing a file's part 0 is done
  // before the rank writing its part 1.
  ProgressSum sum({Before(1, 100), Before(1, 100)});
  sum.Take(0, ProgressSum::Post(Counts(1, 100), true));
  sum.Take(1, ProgressSum::Post(Counts(1, 60), false));
  EXPECT_FALSE(sum.AllLast());
  EXPECT_EQ(sum.Sum(1).done, 1);
  EXPECT_FALSE(sum.Sum(1).finished());

  sum.Take(1, ProgressSum::Post(Counts(1, 100), true));
  EXPECT_TRUE(sum.AllLast());
  const Progress whole = sum.Sum(2);
  EXPECT_TRUE(whole.finished());
  EXPECT_EQ(whole.done, 2);
  EXPECT_EQ(whole.bytes_done, 200);
}

TEST(ProgressSumTest, IgnoresPostsThatDoNotParseOrComeFromNoRank) {
  ProgressSum sum({Before(2, 200), Before(2, 200)});
  sum.Take(1, ProgressSum::Post(Counts(1, 10), false));
  sum.Take(1, "garbage");
  sum.Take(2, ProgressSum::Post(Counts(9, 900), true));
  sum.Take(-1, ProgressSum::Post(Counts(9, 900), true));
  EXPECT_EQ(sum.Sum(1).done, 1);
  EXPECT_EQ(sum.Sum(1).bytes_done, 10);
  EXPECT_FALSE(sum.AllLast());
}

// Two ranks in one thread: the collective hands out what the test says each
// rank gives, and rank 1's posts wait in a queue for rank 0.
struct Wire {
  std::vector<std::string> everyone;  // what each rank gives AllGather
  std::deque<std::string> posts;
  int gathers = 0;
};

class FakeCluster : public Cluster {
 public:
  FakeCluster(int rank, Wire* wire, Status can_post) : rank_(rank), wire_(wire), can_post_(std::move(can_post)) {}
  int rank() const override { return rank_; }
  int size() const override { return 2; }
  Status AllOk(const Status& mine) override { return mine; }
  Result<std::string> Broadcast(const std::string& from_root) override { return from_root; }
  Result<std::vector<std::string>> AllGather(const std::string& mine) override {
    ++wire_->gathers;
    EXPECT_EQ(mine, wire_->everyone.at(rank_));
    return wire_->everyone;
  }
  Status CanPostFromAnyThread() const override { return can_post_; }
  bool Post(const std::string& message, bool) override {
    wire_->posts.push_back(message);
    return true;
  }
  std::vector<std::pair<int, std::string>> Received() override {
    std::vector<std::pair<int, std::string>> got;
    for (; !wire_->posts.empty(); wire_->posts.pop_front()) got.emplace_back(1, wire_->posts.front());
    return got;
  }

 private:
  const int rank_;
  Wire* const wire_;
  const Status can_post_;
};

TEST(ClusterProgressTest, RankZeroShowsTheWholeJobAndEndsWithIt) {
  Wire wire;
  FakeCluster zero(0, &wire, Status::Ok()), one(1, &wire, Status::Ok());
  std::vector<Progress> shown;
  ClusterProgress on_zero(&zero, [&](const Progress& p) { shown.push_back(p); });
  ClusterProgress on_one(&one, nullptr);  // the other ranks show nothing, but post
  wire.everyone = {"2 200", "3 300"};  // each rank's totals
  ASSERT_TRUE(on_zero.Begin(Before(2, 200)).ok());
  ASSERT_TRUE(on_one.Begin(Before(3, 300)).ok());
  EXPECT_EQ(wire.gathers, 2);
  EXPECT_EQ(on_zero.note(), "");

  on_one.Callback()(Counts(1, 100));
  ASSERT_EQ(wire.posts.size(), 1u);
  on_zero.Callback()(Counts(2, 200));
  ASSERT_EQ(shown.size(), 1u);
  EXPECT_EQ(shown[0].done, 3);
  EXPECT_EQ(shown[0].total, 5);
  EXPECT_EQ(shown[0].bytes_done, 300);
  EXPECT_EQ(shown[0].bytes, 500);

  on_one.Callback()(Counts(3, 300));
  on_one.Finish();
  on_zero.Finish();
  EXPECT_TRUE(wire.posts.empty());
  EXPECT_EQ(shown.back().done, 5);
  EXPECT_EQ(shown.back().bytes_done, 500);
  EXPECT_TRUE(shown.back().finished());
}

TEST(ClusterProgressTest, WithoutPostsRankZeroShowsItsShareAndSaysWhy) {
  Wire wire;
  FakeCluster zero(0, &wire, Status::Unsupported("the library lets one thread call it"));
  std::vector<Progress> shown;
  ClusterProgress progress(&zero, [&](const Progress& p) { shown.push_back(p); });
  ASSERT_TRUE(progress.Begin(Before(2, 200)).ok());
  EXPECT_EQ(wire.gathers, 0);
  EXPECT_NE(progress.note().find("rank 0's share"), std::string::npos) << progress.note();
  EXPECT_NE(progress.note().find("the library lets one thread call it"), std::string::npos) << progress.note();
  progress.Callback()(Counts(1, 100));
  progress.Finish();
  ASSERT_EQ(shown.size(), 1u);
  EXPECT_EQ(shown[0].done, 1);
  EXPECT_EQ(shown[0].total, 0);  // as given: the executor's own
}

TEST(ClusterProgressTest, AloneTheCallbackIsTheShowItself) {
  int calls = 0;
  ClusterProgress progress(nullptr, [&](const Progress&) { ++calls; });
  ASSERT_TRUE(progress.Begin(Before(2, 200)).ok());
  progress.Callback()(Counts(2, 200));
  progress.Finish();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(progress.note(), "");

  std::unique_ptr<Cluster> local = Cluster::Local();
  ClusterProgress quiet(local.get(), nullptr);
  EXPECT_FALSE(quiet.Callback());  // no callback: the executor counts nothing for it
}

}  // namespace
}  // namespace reshard
