// Holds the extension's one NumPy C API table and fills it.

#define HOSTCALLBACK_NUMPY_API_DEFINED_HERE
#include "numpy_api.h"

namespace hostcallback {

bool ImportNumpyApi() { return _import_array() >= 0; }

}  // namespace hostcallback
