// Reading one item of a PyTorch Distributed Checkpoint from its `.distcp`
// file.
//
// torch 2.6 writes every item (a tensor chunk or a pickled plain object) as a
// complete torch.save archive at the offset and length the `.metadata` records
// (container/dcp_metadata.h), its zip offsets relative to its own start; so an
// item is ReadTorchArchive over that window of the file, and a tensor chunk's
// bytes stay in the file's memory map until touched.
#pragma once

#include <memory>
#include <string>

#include "container/dcp_metadata.h"
#include "container/mapped_file.h"
#include "pickle/value.h"
#include "reshard/status.h"

namespace reshard {

// The object stored at `storage` in `file` (the file of the checkpoint
// folder that storage.relative_path names): for a bytes item the plain
// object, for a chunk its tensor.
Result<Value> ReadDcpItem(std::shared_ptr<const MappedFile> file, const DcpStorage& storage);

// The tensor of `fqn`'s chunk `chunk` of the checkpoint `meta` describes,
// read from `file`, the file its storage entry names: a contiguous tensor of
// the item's dtype and the chunk's sizes (InvalidInput, naming the file and
// window, when the archive holds anything else).
Result<Value> ReadDcpChunk(std::shared_ptr<const MappedFile> file, const DcpMetadata& meta,
                           const std::string& fqn, const Box& chunk);

// Reads every record of every item `meta` stores in `file` (the file of the
// checkpoint folder named `name`) and refuses the first whose bytes do not
// have the CRC-32 its archive records, naming the file and the item's window
// (`lint --deep`).
Status CheckDcpItemCrcs(const MappedFile& file, const std::string& name, const DcpMetadata& meta);

}  // namespace reshard
