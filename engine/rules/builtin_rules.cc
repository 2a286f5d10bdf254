#include "rules/builtin_rules.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>

#include "rules/rule_set.h"
#include "util/list_folder.h"
#include "util/loaded_file.h"
#include "util/strings.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

// The environment's choice; else the source tree's rules/ where it is (a
// build); else rules/ beside the binary or Python module running this code (a
// pip-installed package, whose build compiles in no path); else the installed
// copy (`make install`).
std::string BuiltinRulesDir() {
  const char* env = std::getenv("RESHARD_RULES_DIR");
  if (env != nullptr && *env != '\0') return env;
  std::error_code ignored;
#ifdef RESHARD_RULES_DIR
  if (fs::is_directory(RESHARD_RULES_DIR, ignored)) return RESHARD_RULES_DIR;
#endif
  const std::string loaded_from = LoadedFileFolder();
  const std::string beside = loaded_from.empty() ? "" : (fs::path(loaded_from) / "rules").string();
#ifdef RESHARD_INSTALLED_RULES_DIR
  if (beside.empty() || !fs::is_directory(beside, ignored)) return RESHARD_INSTALLED_RULES_DIR;
#endif
  return beside;
}

// The rule files of `dir` in file name order, each with its size and
// modification time: what the parsed sets are cached under.
struct RuleFiles {
  std::vector<fs::path> paths;
  std::vector<std::pair<uintmax_t, fs::file_time_type>> stamps;
  bool operator==(const RuleFiles& o) const { return paths == o.paths && stamps == o.stamps; }
};

Result<RuleFiles> ListRuleFiles(const std::string& dir) {
  Result<std::vector<fs::directory_entry>> entries = ListFolder(dir);
  if (!entries.ok()) return Status::IoError(entries.status().message() + "; set RESHARD_RULES_DIR");
  RuleFiles files;
  for (const fs::directory_entry& entry : *entries) {
    if (entry.path().extension() == ".yaml") files.paths.push_back(entry.path());
  }
  if (files.paths.empty()) return Status::RuleError("no *.yaml rule files in '" + dir + "'; set RESHARD_RULES_DIR");
  std::sort(files.paths.begin(), files.paths.end(),
            [](const fs::path& a, const fs::path& b) { return a.filename() < b.filename(); });
  for (const fs::path& path : files.paths) {
    std::error_code ec;
    const uintmax_t size = fs::file_size(path, ec);
    files.stamps.emplace_back(ec ? 0 : size, fs::last_write_time(path, ec));
  }
  return files;
}

Result<std::vector<RuleSet>> ParseRuleFiles(const RuleFiles& files) {
  std::vector<RuleSet> sets;
  for (const fs::path& file : files.paths) {
    RESHARD_ASSIGN_OR_RETURN(RuleSet rs, RuleSet::LoadFile(file.string()));
    for (const RuleSet& other : sets) {
      if (other.name() == rs.name()) {
        return Status::RuleError(rs.origin() + ": rule set name '" + rs.name() + "' is already used by " +
                                 other.origin() + "; rename one");
      }
    }
    sets.push_back(std::move(rs));
  }
  return sets;
}

}  // namespace

// Parsed once per process while the files stay as they were: every open of
// a checkpoint chooses among them, and a process (the Python module, verify)
// opens many.
Result<std::vector<RuleSet>> LoadBuiltinRuleSets() {
  static std::mutex mu;
  static std::map<std::string, std::pair<RuleFiles, std::vector<RuleSet>>>* parsed =
      new std::map<std::string, std::pair<RuleFiles, std::vector<RuleSet>>>;  // never destroyed: used at exit
  const std::string dir = BuiltinRulesDir();
  RESHARD_ASSIGN_OR_RETURN(RuleFiles files, ListRuleFiles(dir));
  std::lock_guard<std::mutex> lock(mu);
  auto it = parsed->find(dir);
  if (it != parsed->end() && it->second.first == files) return it->second.second;
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> sets, ParseRuleFiles(files));
  (*parsed)[dir] = {std::move(files), sets};
  return sets;
}

bool IsBuiltinRuleFile(const std::string& path) {
  std::error_code ec;
  const fs::path dir = fs::canonical(BuiltinRulesDir(), ec);
  return !ec && fs::canonical(path, ec).parent_path() == dir && !ec;
}

Result<RuleSet> LoadRuleSet(const std::string& spec) {
  std::error_code ec;
  if (fs::is_regular_file(spec, ec)) return RuleSet::LoadFile(spec);
  fs::path as_path(spec);
  if (as_path.has_parent_path() || as_path.extension() == ".yaml" || as_path.extension() == ".yml") {
    return Status::InvalidInput("rule file '" + spec + "' not found");
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> builtin, LoadBuiltinRuleSets());
  std::vector<std::string> names;
  for (RuleSet& rs : builtin) {
    if (rs.name() == spec) return std::move(rs);
    names.push_back(rs.name());
  }
  if (const std::string* typo = ClosestName(spec, names)) {
    return Status::InvalidInput("unknown rule set '" + spec + "'; did you mean '" + *typo + "'?");
  }
  return Status::InvalidInput("unknown rule set '" + spec + "'; built-in: " + Join(names, ", ") +
                              "; or pass the path of a rule file");
}

std::string CopiedBuiltinNameNote(const std::string& spec) {
  std::error_code ec;
  if (!fs::is_regular_file(spec, ec) || IsBuiltinRuleFile(spec)) return "";
  Result<RuleSet> copy = RuleSet::LoadFile(spec);
  Result<std::vector<RuleSet>> builtin = LoadBuiltinRuleSets();
  if (!copy.ok() || !builtin.ok()) return "";  // the command that loads it says why
  for (const RuleSet& rs : *builtin) {
    if (rs.name() != copy->name()) continue;
    return "rule file " + spec + " keeps the name '" + rs.name() + "' of the built-in rule set " + rs.origin() +
           ", so messages call it by that name; give it a name: of its own";
  }
  return "";
}

Result<std::vector<RuleSet>> RuleSetsWithSection(const std::string& spec, const std::string& section,
                                                 const std::function<bool(const RuleSet&)>& has,
                                                 const std::string& what) {
  std::vector<RuleSet> out;
  if (!spec.empty()) {
    RESHARD_ASSIGN_OR_RETURN(RuleSet rules, LoadRuleSet(spec));
    if (!has(rules)) {
      return Status::RuleError("rule set " + rules.name() + " has no " + section + " section, so it cannot read " +
                               what + "; add one (docs/rules.md) or choose another set");
    }
    out.push_back(std::move(rules));
    return out;
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> all, LoadBuiltinRuleSets());
  for (RuleSet& rules : all) {
    if (has(rules)) out.push_back(std::move(rules));
  }
  return out;
}

}  // namespace reshard
