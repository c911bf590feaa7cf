// Makes `ringseq._C` an importable Python module. Importing it runs the static initializers
// that register the `torch.ops.ringseq.*` operators (csrc/ops.cpp); the module itself says how
// it was built and which ISA level the CPU kernel uses (csrc/cpu/dispatch.cpp).
#include <Python.h>

#include <string>

#include "cpu/flash_cpu.h"

namespace {

PyObject* split_levels(const std::string& csv) {
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  size_t start = 0;
  while (start < csv.size()) {
    size_t end = csv.find(',', start);
    if (end == std::string::npos) end = csv.size();
    PyObject* s = PyUnicode_FromStringAndSize(csv.data() + start, static_cast<Py_ssize_t>(end - start));
    if (s == nullptr || PyList_Append(out, s) != 0) {
      Py_XDECREF(s);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(s);
    start = end + 1;
  }
  return out;
}

// cpu_isa() -> str: the level in use; RuntimeError if RINGSEQ_CPU_ISA forces one this CPU lacks.
PyObject* cpu_isa(PyObject*, PyObject*) {
  std::string name, error;
  if (!ringseq::cpu::isa_active(&name, &error)) {
    PyErr_SetString(PyExc_RuntimeError, error.c_str());
    return nullptr;
  }
  return PyUnicode_FromString(name.c_str());
}

PyObject* cpu_isa_supported(PyObject*, PyObject*) { return split_levels(ringseq::cpu::isa_supported()); }

PyObject* cpu_isa_built(PyObject*, PyObject*) { return split_levels(ringseq::cpu::isa_built()); }

// _cpu_isa_auto(vendor=None, level=None) -> str (positional arguments): the level
// RINGSEQ_CPU_ISA=auto picks on a CPU of cpuid vendor `vendor` whose highest level is `level`,
// each None meaning this CPU's own; RuntimeError for an unknown level name.
PyObject* cpu_isa_auto(PyObject*, PyObject* args) {
  const char* vendor = nullptr;
  const char* level = nullptr;
  if (!PyArg_ParseTuple(args, "|zz", &vendor, &level)) return nullptr;
  const std::string v = vendor ? vendor : "", l = level ? level : "";
  std::string error;
  const std::string name = ringseq::cpu::isa_auto(vendor ? &v : nullptr, level ? &l : nullptr, &error);
  if (name.empty()) {
    PyErr_SetString(PyExc_RuntimeError, error.c_str());
    return nullptr;
  }
  return PyUnicode_FromString(name.c_str());
}

// _set_cpu_isa(level or None): force a level in this process (None: resolve RINGSEQ_CPU_ISA
// again at the next call).
PyObject* set_cpu_isa(PyObject*, PyObject* arg) {
  std::string request;
  if (arg != Py_None) {
    const char* s = PyUnicode_AsUTF8(arg);
    if (s == nullptr) return nullptr;
    request = s;
  }
  std::string error;
  if (!ringseq::cpu::isa_force(request, &error)) {
    PyErr_SetString(PyExc_RuntimeError, error.c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// _cpu_head_rows_bytes([value]) -> int: the previous per-thread budget of packed input rows
// (bytes); an int >= 0 (positional) sets it for later kernel calls, None or nothing only reads.
PyObject* cpu_head_rows_bytes(PyObject*, PyObject* args) {
  PyObject* value = Py_None;
  if (!PyArg_ParseTuple(args, "|O", &value)) return nullptr;
  long long v = -1;
  if (value != Py_None) {
    v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) return nullptr;
    if (v < 0) {
      PyErr_Format(PyExc_ValueError,
                   "_cpu_head_rows_bytes(value): value must be None or a byte count >= 0, got %lld", v);
      return nullptr;
    }
  }
  return PyLong_FromLongLong(ringseq::cpu::head_rows_bytes(v));
}

PyMethodDef kMethods[] = {
    {"cpu_isa", cpu_isa, METH_NOARGS,
     "ISA level of the CPU kernel in use (baseline, avx2, avx512, avx512bf16, amx), chosen at first use"},
    {"cpu_isa_supported", cpu_isa_supported, METH_NOARGS,
     "ISA levels built into this extension that this CPU can run, lowest first"},
    {"cpu_isa_built", cpu_isa_built, METH_NOARGS, "ISA levels built into this extension"},
    {"_cpu_isa_auto", cpu_isa_auto, METH_VARARGS,
     "_cpu_isa_auto(vendor=None, level=None), positional: the level auto picks on a CPU of that "
     "cpuid vendor whose highest level is `level` (None: this CPU's own)"},
    {"_set_cpu_isa", set_cpu_isa, METH_O,
     "Force the CPU kernel's ISA level in this process (None: back to RINGSEQ_CPU_ISA/auto)"},
    {"_cpu_head_rows_bytes", cpu_head_rows_bytes, METH_VARARGS,
     "Per-thread budget (bytes) of input rows the CPU kernel packs once per head; returns the "
     "previous value, sets it when given (results do not depend on it; for tests and benchmarks)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C",
                       "ringseq's compiled kernels; the operators live in torch.ops.ringseq",
                       -1, kMethods};

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
