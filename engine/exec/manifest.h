// Manifest: what a writing command put into its output folder, recorded in
// it as `reshard-manifest.json`: the tool, the command, the source, and each
// file's size and CRC-32 as computed while the file was written (no second
// read). `reshard verify OUT` checks a folder against it.
#pragma once

#include <map>
#include <string>

#include "reshard/status.h"
#include "util/crc32.h"

namespace reshard {

inline constexpr char kManifestName[] = "reshard-manifest.json";

struct Manifest {
  std::string tool;     // "reshard 0.1.0"
  std::string command;  // as the caller gave it ("" when none)
  std::string source;   // the input checkpoint's folder
  std::string summary;  // the source's one-line summary
  std::map<std::string, FileDigest> files;  // name in the folder -> digest
};

// The manifest as JSON (files by name; CRCs as 8 hex digits).
std::string ManifestJson(const Manifest& manifest);

// Each file's digest from the pieces its jobs reported (in any order); an
// error if a file's pieces leave a gap or overlap.
Result<std::map<std::string, FileDigest>> WholeFiles(const std::multimap<std::string, FileDigest>& pieces);

// Reads the manifest at `path`; errors name the file and what is wrong.
Result<Manifest> ReadManifest(const std::string& path);

// The manifest in `text`, read from `path` (named in errors). Every file
// name must be a relative path inside the folder: no empty, `.` or `..`
// component and no leading `/`, so that `verify` reads nothing outside it.
Result<Manifest> ParseManifest(const std::string& text, const std::string& path);

}  // namespace reshard
