// RunJournal: a rerun reuses exactly the jobs the journal records whose
// files still read back with their CRCs.
#include "exec/journal.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace reshard {
namespace {

// A job writing `text` as the file `name` and reporting its digest.
Job TextJob(const std::string& name, const std::string& text) {
  return {name, static_cast<int64_t>(text.size()), [name, text](JobContext& ctx) {
            std::ofstream(ctx.dir + "/" + name) << text;
            const auto* bytes = reinterpret_cast<const uint8_t*>(text.data());
            if (ctx.wrote) ctx.wrote(name, {static_cast<int64_t>(text.size()), Crc32(0, bytes, text.size())});
            return Status::Ok();
          }};
}

std::vector<Job> Jobs() { return {TextJob("a", "alpha"), TextJob("b", "bravo"), TextJob("c", "charlie")}; }

void RunAll(std::vector<Job>* jobs, const std::string& dir) {
  std::vector<uint8_t> buffer(16);
  JobContext ctx{dir, buffer, [](int64_t) {}, nullptr};
  for (Job& job : *jobs) ASSERT_TRUE(job.run(ctx).ok());
}

std::vector<std::string> Names(const std::vector<Job>& jobs) {
  std::vector<std::string> names;
  for (const Job& job : jobs) names.push_back(job.name);
  return names;
}

class RunJournalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(RunJournal::Create(dir_, "f1").ok());
    EXPECT_TRUE(HoldsJournalOf(dir_, "f1"));
    EXPECT_FALSE(HoldsJournalOf(dir_, "f2"));
    Result<std::unique_ptr<RunJournal>> journal = RunJournal::Open(dir_);
    ASSERT_TRUE(journal.ok()) << journal.status().message();
    std::vector<Job> first = Jobs();
    first.pop_back();  // "killed" before c finished
    (*journal)->RecordWhenDone(&first);
    RunAll(&first, dir_);
  }

  std::vector<Job> Rerun(int64_t* bytes) {
    Result<std::unique_ptr<RunJournal>> journal = RunJournal::Open(dir_);
    EXPECT_TRUE(journal.ok());
    std::vector<Job> jobs = Jobs();
    reused_ = (*journal)->Reuse(&jobs, bytes);
    return jobs;
  }

  TempDir tmp_;
  const std::string dir_ = tmp_.path().string();
  std::vector<std::pair<std::string, FileDigest>> reused_;
};

TEST_F(RunJournalTest, FinishedJobsAreReusedAndTheRestRunAgain) {
  int64_t bytes = 0;
  EXPECT_EQ(Names(Rerun(&bytes)), std::vector<std::string>{"c"});
  EXPECT_EQ(bytes, 10);
  ASSERT_EQ(reused_.size(), 2u);
  EXPECT_EQ(reused_[0].first, "a");
  EXPECT_EQ(reused_[0].second.crc32, Crc32(0, reinterpret_cast<const uint8_t*>("alpha"), 5));
}

TEST_F(RunJournalTest, AFileThatChangedIsWrittenAgain) {
  std::ofstream(dir_ + "/b") << "bravO";
  int64_t bytes = 0;
  EXPECT_EQ(Names(Rerun(&bytes)), (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(bytes, 5);
}

TEST_F(RunJournalTest, ALineTheKillCutShortIsNotUsed) {
  const std::string cut = "job\tc\t0\tc\t0\t7\t" + std::to_string(Crc32(0, reinterpret_cast<const uint8_t*>("charlie"), 7));
  std::ofstream(dir_ + "/c") << "charlie";
  std::ofstream(dir_ + "/" + kJournalName, std::ios::app) << cut;  // no newline
  int64_t bytes = 0;
  EXPECT_EQ(Names(Rerun(&bytes)), std::vector<std::string>{"c"});
  std::ofstream(dir_ + "/" + kJournalName, std::ios::app) << "\n";  // the whole line
  EXPECT_TRUE(Rerun(&bytes).empty());
}

TEST(FingerprintTest, DiffersWithTheText) {
  EXPECT_EQ(Fingerprint("convert a b"), Fingerprint("convert a b"));
  EXPECT_NE(Fingerprint("convert a b"), Fingerprint("convert a c"));
  EXPECT_EQ(Fingerprint("x").size(), 24u);
}

}  // namespace
}  // namespace reshard
