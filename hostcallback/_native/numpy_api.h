// The NumPy C API, as every file of the extension includes it: one function table for the whole
// extension (PY_ARRAY_UNIQUE_SYMBOL), filled once by ImportNumpyApi when the module loads.
// Include this header before any other NumPy header, and never <numpy/arrayobject.h> directly.
#ifndef HOSTCALLBACK_NATIVE_NUMPY_API_H_
#define HOSTCALLBACK_NATIVE_NUMPY_API_H_

#define PY_ARRAY_UNIQUE_SYMBOL hostcallback_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#ifndef HOSTCALLBACK_NUMPY_API_DEFINED_HERE  // numpy_api.cc holds the table; the others use it
#define NO_IMPORT_ARRAY
#endif
#include <Python.h>
#include <numpy/arrayobject.h>

namespace hostcallback {

// Fills the table (numpy's import_array); false with a Python error set when NumPy cannot be
// imported. Called once, by the module's initialization, before anything else uses NumPy.
bool ImportNumpyApi();

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_NUMPY_API_H_
