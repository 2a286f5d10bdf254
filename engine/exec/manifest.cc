#include "exec/manifest.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "container/regular_file.h"
#include "container/safetensors_writer.h"

namespace reshard {
namespace {

std::string Hex(uint32_t crc) {
  char hex[9];
  std::snprintf(hex, sizeof(hex), "%08x", crc);
  return hex;
}

Status Malformed(const std::string& path, const std::string& what) {
  return Status::InvalidInput(path + " is not a reshard manifest (" + what + ")");
}

// Whether `name` stays inside the folder it is relative to, by its text.
bool InsideFolder(const std::string& name) {
  if (name.empty() || name.front() == '/') return false;
  for (size_t begin = 0; begin <= name.size();) {
    const size_t end = std::min(name.find('/', begin), name.size());
    const std::string part = name.substr(begin, end - begin);
    if (part.empty() || part == "." || part == "..") return false;
    begin = end + 1;
  }
  return true;
}

}  // namespace

std::string ManifestJson(const Manifest& m) {
  std::string json = "{\n  \"tool\": " + JsonString(m.tool) + ",\n  \"command\": " + JsonString(m.command) +
                     ",\n  \"source\": " + JsonString(m.source) + ",\n  \"source_summary\": " +
                     JsonString(m.summary) + ",\n  \"files\": [\n";
  size_t i = 0;
  for (const auto& [name, d] : m.files) {
    json += "    {\"name\": " + JsonString(name) + ", \"bytes\": " + std::to_string(d.bytes) +
            ", \"crc32\": \"" + Hex(d.crc32) + "\"}" + (++i < m.files.size() ? ",\n" : "\n");
  }
  return json + "  ]\n}\n";
}

Result<std::map<std::string, FileDigest>> WholeFiles(const std::multimap<std::string, FileDigest>& pieces) {
  std::map<std::string, std::vector<FileDigest>> by_file;
  for (const auto& [name, piece] : pieces) by_file[name].push_back(piece);
  std::map<std::string, FileDigest> files;
  for (auto& [name, parts] : by_file) {
    std::sort(parts.begin(), parts.end(), [](const FileDigest& a, const FileDigest& b) { return a.offset < b.offset; });
    FileDigest whole;
    for (const FileDigest& part : parts) {
      if (part.offset != whole.bytes) {
        return Status::Internal("the pieces written of " + name + " do not join at byte " + std::to_string(whole.bytes));
      }
      whole.crc32 = Crc32Combine(whole.crc32, part.crc32, part.bytes);
      whole.bytes += part.bytes;
    }
    files[name] = whole;
  }
  return files;
}

Result<Manifest> ReadManifest(const std::string& path) {
  // A manifest lists one line per file; a folder of a million files has a
  // manifest of about 100 MB.
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadRegularFile(path, int64_t{256} << 20));
  return ParseManifest(text, path);
}

// JSON is read with the YAML parser, which accepts it.
Result<Manifest> ParseManifest(const std::string& text, const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return Malformed(path, e.what());
  }
  if (!root.IsMap() || !root["files"] || !root["files"].IsSequence()) return Malformed(path, "no files list");
  Manifest m;
  try {
    m.tool = root["tool"] ? root["tool"].as<std::string>() : "";
    m.command = root["command"] ? root["command"].as<std::string>() : "";
    m.source = root["source"] ? root["source"].as<std::string>() : "";
    m.summary = root["source_summary"] ? root["source_summary"].as<std::string>() : "";
    for (const YAML::Node& f : root["files"]) {
      const std::string name = f["name"].as<std::string>();
      const int64_t bytes = f["bytes"].as<int64_t>();
      const std::string crc = f["crc32"].as<std::string>();
      if (name.empty() || bytes < 0 || crc.size() != 8 || crc.find_first_not_of("0123456789abcdef") != std::string::npos) {
        return Malformed(path, "a bad entry for '" + name + "'");
      }
      if (!InsideFolder(name)) {
        return Status::InvalidInput(path + " lists '" + name + "', which is not a file inside its folder (an "
                                    "absolute path, or one with an empty, '.' or '..' part); reshard never "
                                    "writes such a name, so the manifest was edited: regenerate the output");
      }
      if (!m.files.emplace(name, FileDigest{bytes, static_cast<uint32_t>(std::stoul(crc, nullptr, 16))}).second) {
        return Malformed(path, "'" + name + "' listed twice");
      }
    }
  } catch (const YAML::Exception& e) {
    return Malformed(path, e.what());
  }
  return m;
}

}  // namespace reshard
