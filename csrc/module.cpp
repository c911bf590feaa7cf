// Makes `ringseq._C` an importable Python module. Importing it runs the static initializers
// that register the `torch.ops.ringseq.*` operators (csrc/ops.cpp); the module itself only
// says how it was built.
#include <Python.h>

namespace {

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C",
                       "ringseq's compiled kernels; the operators live in torch.ops.ringseq",
                       -1, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
#ifdef RINGSEQ_WITH_CUDA
  PyModule_AddObject(m, "WITH_CUDA", Py_NewRef(Py_True));
#else
  PyModule_AddObject(m, "WITH_CUDA", Py_NewRef(Py_False));
#endif
  return m;
}
