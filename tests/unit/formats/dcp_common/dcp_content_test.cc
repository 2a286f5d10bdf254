// ReadTorchDistMarker: a torch_dist folder's metadata.json is Megatron-Core's
// or refused by name, never taken for a plain DCP folder's absence of one.
#include "formats/dcp_common/dcp_content.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "test_util.h"

namespace reshard {
namespace {

// ReadTorchDistMarker of a folder whose metadata.json holds `text`: "yes",
// "no", or the error.
std::string MarkerOf(const TempDir& dir, const std::string& text) {
  std::ofstream(dir.path() / "metadata.json") << text;
  Result<bool> marker = ReadTorchDistMarker(dir.path().string());
  if (!marker.ok()) return marker.status().message();
  return *marker ? "yes" : "no";
}

TEST(TorchDistMarkerTest, MegatronCoresFilesAreRead) {
  TempDir dir;
  EXPECT_EQ(ReadTorchDistMarker(dir.path().string()).value(), false);  // plain DCP: no metadata.json
  EXPECT_EQ(MarkerOf(dir, R"({"sharded_backend": "torch_dist", "sharded_backend_version": 1})"), "yes");
  EXPECT_EQ(MarkerOf(dir, R"({"sharded_backend": "torch_dist", "sharded_backend_version": 1, )"
                          R"("common_backend": "torch", "common_backend_version": 1})"),
            "yes");
}

TEST(TorchDistMarkerTest, AnythingElseIsRefusedByName) {
  TempDir dir;
  const std::string path = (dir.path() / "metadata.json").string();
  for (const auto& [text, problem] : std::vector<std::pair<std::string, std::string>>{
           {"", "is not valid JSON"},
           {"{", "is not valid JSON"},
           {"[1]", "holds [1], not a JSON object"},
           {R"({"sharded_backend": "zarr", "sharded_backend_version": 1})",
            "has sharded_backend 'zarr' where Megatron-Core writes 'torch_dist'"},
           {R"({"sharded_backend_version": 1})", "has no sharded_backend"},
           {R"({"sharded_backend": "torch_dist", "sharded_backend_version": 99})",
            "has sharded_backend_version 99 where Megatron-Core writes 1"},
           {R"({"sharded_backend": "torch_dist", "sharded_backend_version": 1.0})",
            "has sharded_backend_version 1.0 where"},
           {R"({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "zarr"})",
            "has common_backend 'zarr'"}}) {
    const std::string message = MarkerOf(dir, text);
    EXPECT_EQ(message.rfind(path, 0), 0u) << text << ": " << message;
    EXPECT_NE(message.find(problem), std::string::npos) << text << ": " << message;
  }
}

}  // namespace
}  // namespace reshard
