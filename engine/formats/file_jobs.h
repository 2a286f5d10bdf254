// Jobs that each write one whole file of an output folder: a torch.save file
// of a pickled tree whose tensors are produced while it is written, or a
// small text file. Every writing format makes its files with these.
//
// It sits in formats/ itself, beside format.h, because format folders share
// it and may not include each other.
#pragma once

#include <functional>
#include <string>

#include "exec/job.h"
#include "pickle/value.h"

namespace reshard {

// A job writing `root` as the torch.save file `name` (a path under the
// output folder; its parent folders are made), its size the bytes of the
// storages it holds.
Result<Job> TorchFileJob(std::string name, Value root);

// The same for the tree `make` builds, which it builds when the job runs
// (and once now, for the size), so that a plan of many files holds the tree
// of the files being written only.
Result<Job> TorchFileJob(std::string name, std::function<Result<Value>()> make);

// A job writing `text` as the file `name` of the output folder.
Job TextFileJob(std::string name, std::string text);

// A job copying the file at `from` as the file `name` of the output folder,
// through the worker's buffer. `bytes` is what it counts as the tensor bytes
// it streams (and reports as progress): the file's size for a copied
// checkpoint file, 0 for a file beside the tensors.
Job CopyFileJob(std::string name, std::string from, int64_t bytes);

}  // namespace reshard
