// libFuzzer target: reshard's pickle reader on arbitrary bytes. Every input
// must give a Value or a Status; a crash, a hang or a sanitizer report is a
// bug. Seeds: the data.pkl of real torch.save files (corpus/pickle).
#include <cstddef>
#include <cstdint>

#include "pickle/pickle_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  reshard::PickleReader reader(reshard::PickleReadOptions{}, nullptr);
  (void)reader.Parse(data, size);
  return 0;
}
