#include "reshard/cluster.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <iterator>
#include <optional>
#include <string>

namespace reshard {
namespace {

// Clears the launcher variables for one test and restores them after, so
// the tests behave the same when ctest itself runs under a launcher.
class LauncherEnv {
 public:
  LauncherEnv() {
    for (size_t i = 0; i < std::size(kNames); ++i) {
      if (const char* value = std::getenv(kNames[i])) saved_[i] = value;
      ::unsetenv(kNames[i]);
    }
  }
  ~LauncherEnv() {
    for (size_t i = 0; i < std::size(kNames); ++i) {
      if (saved_[i]) {
        ::setenv(kNames[i], saved_[i]->c_str(), 1);
      } else {
        ::unsetenv(kNames[i]);
      }
    }
  }

 private:
  static constexpr const char* kNames[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                           "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"};
  std::optional<std::string> saved_[std::size(kNames)];
};

TEST(ClusterTest, LocalIsAGroupOfOne) {
  std::unique_ptr<Cluster> cluster = Cluster::Local();
  EXPECT_EQ(cluster->rank(), 0);
  EXPECT_EQ(cluster->size(), 1);
  EXPECT_TRUE(cluster->AllOk(Status::Ok()).ok());
  // A group of one reports its own failure unchanged, without "rank 0: ".
  Status st = cluster->AllOk(Status::IoError("disk full"));
  EXPECT_EQ(st.code(), Status::Code::kIoError);
  EXPECT_EQ(st.message(), "disk full");
  Result<std::string> got = cluster->Broadcast("plan");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, "plan");
}

TEST(ClusterTest, JoinWithoutLauncherIsLocal) {
  LauncherEnv env;
  // A batch script's task count is no launcher.
  ::setenv("SLURM_NTASKS", "4", 1);
  EXPECT_EQ(*Cluster::LaunchedSize(), 1);
  Result<std::unique_ptr<Cluster>> cluster = Cluster::Join();
  ASSERT_TRUE(cluster.ok()) << cluster.status().message();
  EXPECT_EQ((*cluster)->size(), 1);
}

TEST(ClusterTest, LaunchedSizeReadsTheLauncher) {
  LauncherEnv env;
  ::setenv("SLURM_STEP_NUM_TASKS", "3", 1);
  EXPECT_EQ(*Cluster::LaunchedSize(), 3);
  ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);  // mpirun's own count wins
  EXPECT_EQ(*Cluster::LaunchedSize(), 2);
}

TEST(ClusterTest, LauncherGroupOfOneNeedsNoMpi) {
  LauncherEnv env;
  ::setenv("OMPI_COMM_WORLD_SIZE", "1", 1);
  Result<std::unique_ptr<Cluster>> cluster = Cluster::Join();
  ASSERT_TRUE(cluster.ok()) << cluster.status().message();
  EXPECT_EQ((*cluster)->size(), 1);
}

TEST(ClusterTest, GarbledLauncherCountIsAnError) {
  LauncherEnv env;
  ::setenv("PMI_SIZE", "two", 1);
  Result<int> size = Cluster::LaunchedSize();
  ASSERT_FALSE(size.ok());
  EXPECT_EQ(size.status().code(), Status::Code::kInvalidInput);
  EXPECT_NE(size.status().message().find("PMI_SIZE='two'"), std::string::npos);
  EXPECT_FALSE(Cluster::Join().ok());
}

}  // namespace
}  // namespace reshard
