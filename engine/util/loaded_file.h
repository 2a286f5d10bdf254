// LoadedFileFolder: the folder of the file this code runs from, so that what
// ships beside it is found wherever it was installed, with no path compiled
// in. The engine is linked into the reshard binary and into the Python module
// (a shared object); a pip-installed package keeps both beside its rule files.
#pragma once

#include <string>

namespace reshard {

// The absolute folder of the executable or shared object this function was
// linked into, as it was when first asked; "" where the system cannot say.
std::string LoadedFileFolder();

}  // namespace reshard
