// The warm call path in C++ (runtime/warm.py builds it once per torch and Python version): a
// table of call layouts that passed runtime/call.py's checks, each with what its launch needs. A call
// that matches one (every tensor's dtype, device, sizes, strides and 16-byte alignment, the scalars'
// and consts' types, the consts' values) allocates its outputs and workspace, fills the layout's
// argument block (abi.h) with the data pointers, scalars, stream and workspace, and calls the kernel
// library's coda_launch: what the Python path does for that layout, without the interpreter. Any
// other call answers None and takes the Python path, which checks it (and may add its layout).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "coda_dsl/abi.h"

namespace {

using Launch = int (*)(coda::CallArgs const*, char*, int64_t);
constexpr int64_t kMessageBytes = 1024;
constexpr size_t kMostValues = 64;    // A, B and the operands of one call (call()'s arrays)
constexpr size_t kMostEntries = 256;  // layouts per table; the oldest goes first

struct Input {  // A, B or an operand tensor, as the layout has it
  int source;   // index into the call's values: 0 = A, 1 = B, 2 + i = the table's operand i
  int slot;     // its TensorArg in the block (-1: an operand the kernel does not read, matched all the same)
  c10::ScalarType dtype;
  c10::Device device;
  int64_t dim, align;
  int64_t sizes[3], strides[3];
};

struct Output {
  PyObject* name;  // owned by the Entry
  std::vector<int64_t> sizes;
  c10::ScalarType dtype;
  int slot;
};

struct Entry {
  std::vector<Input> inputs;
  std::vector<std::pair<int, int>> scalars;    // (call value index, scalar index in the block or -1: unread)
  std::vector<std::pair<int, double>> consts;  // (call value index, the value the kernel was built for)
  std::vector<Output> outputs;
  std::string block;  // the argument block, pointers, stream and workspace zero
  int64_t workspace_size = 0;
  c10::Device device = c10::Device(c10::kCPU);
  Launch launch = nullptr;

  Entry() = default;
  Entry(Entry const&) = delete;
  Entry& operator=(Entry const&) = delete;
  ~Entry() {  // with the GIL: tables live and die in Python
    for (Output& o : outputs) Py_XDECREF(o.name);
  }
};

// Entries are shared: a call holds its own while Python code it runs (an allocation under a dispatch
// mode, a collection) could add to the table or drop the entry from it.
using Entries = std::vector<std::shared_ptr<Entry const>>;

struct Table {
  PyObject_HEAD
  std::vector<PyObject*>* names;  // the epilogue's operands (owned references)
  Entries* entries;
  char message[kMessageBytes];
};

PyObject* kernel_error = nullptr;  // coda_dsl.errors.KernelError, set by set_error_type()

// A Python float or int (not bool, not a subclass: the Python path keys a layout by the value's type).
bool number(PyObject* v, double* out) {
  if (PyFloat_CheckExact(v)) {
    *out = PyFloat_AS_DOUBLE(v);
    return true;
  }
  if (PyLong_CheckExact(v)) {
    *out = PyLong_AsDouble(v);
    if (*out == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return true;
  }
  return false;
}

bool same_const(double got, double want) {  // as the Python key: by spelling, so -0.0 != 0.0, NaN == NaN
  if (std::isnan(got) || std::isnan(want)) return std::isnan(got) && std::isnan(want);
  return std::memcmp(&got, &want, sizeof(double)) == 0;
}

bool matches(Input const& in, at::Tensor const& t, bool grad) {
  if (t.layout() != c10::kStrided || t.scalar_type() != in.dtype || t.device() != in.device || t.dim() != in.dim)
    return false;
  if (grad && t.requires_grad()) return false;  // autograd records it: the Python path
  for (int64_t i = 0; i < in.dim; ++i)
    if (t.sizes()[i] != in.sizes[i] || t.strides()[i] != in.strides[i]) return false;
  return int64_t(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16) == in.align;
}

template <class T>
void put(std::string& block, size_t offset, T value) {
  std::memcpy(&block[offset], &value, sizeof(T));
}

size_t tensor_offset(int slot) { return sizeof(coda::CallArgs) + size_t(slot) * sizeof(coda::TensorArg); }

// The entry of `entries` that this call matches, or null.
std::shared_ptr<Entry const> match(Entries const& entries, PyObject* const* values, double* scalars) {
  bool const grad = at::GradMode::is_enabled();
  for (auto const& e : entries) {
    bool ok = true;
    for (size_t i = 0; ok && i < e->inputs.size(); ++i) {
      PyObject* v = values[e->inputs[i].source];
      // exactly a tensor (or a Parameter): a subclass may change what its metadata means, so Python sees it
      try {
        ok = THPVariable_CheckExact(v) && matches(e->inputs[i], THPVariable_Unpack(v), grad);
      } catch (std::exception const&) {  // metadata it cannot give (no storage): the Python path decides
        ok = false;
      }
    }
    for (size_t i = 0; ok && i < e->scalars.size(); ++i) ok = number(values[e->scalars[i].first], &scalars[i]);
    for (size_t i = 0; ok && i < e->consts.size(); ++i) {
      double c;
      ok = number(values[e->consts[i].first], &c) && same_const(c, e->consts[i].second);
    }
    if (ok) return e;
  }
  return nullptr;
}

// table.call(A, B, operands: dict) -> {output name: tensor}, or None where no layout matches.
PyObject* table_call(Table* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS  // torch's errors (an allocation that runs out of memory) as its Python exceptions
  if (nargs != 3 || !PyDict_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "call(A, B, operands: dict)");
    return nullptr;
  }
  auto const& names = *self->names;
  PyObject* operands = args[2];
  if (PyDict_GET_SIZE(operands) != Py_ssize_t(names.size()) || self->entries->empty() ||
      names.size() + 2 > kMostValues || c10::impl::TorchDispatchModeTLS::stack_len() > 0)
    Py_RETURN_NONE;  // a dispatch mode would see the allocations: the Python path, as torch's ops
  PyObject* values[kMostValues];
  values[0] = args[0];
  values[1] = args[1];
  for (size_t i = 0; i < names.size(); ++i) {
    values[2 + i] = PyDict_GetItemWithError(operands, names[i]);  // borrowed
    if (!values[2 + i]) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;
    }
  }
  double scalars[kMostValues];
  std::shared_ptr<Entry const> const e = match(*self->entries, values, scalars);
  if (!e) Py_RETURN_NONE;

  std::string block = e->block;
  for (Input const& in : e->inputs)  // the tensors matched above, still alive in `values`
    if (in.slot >= 0)
      put(block, tensor_offset(in.slot),
          int64_t(reinterpret_cast<uintptr_t>(THPVariable_Unpack(values[in.source]).data_ptr())));
  size_t const n_tensors = size_t(reinterpret_cast<coda::CallArgs const*>(block.data())->n_tensors);
  for (size_t i = 0; i < e->scalars.size(); ++i)
    if (e->scalars[i].second >= 0)
      put(block, tensor_offset(int(n_tensors)) + sizeof(double) * size_t(e->scalars[i].second), scalars[i]);
  std::vector<at::Tensor> outs;
  outs.reserve(e->outputs.size());
  for (Output const& o : e->outputs) {
    outs.push_back(at::empty(o.sizes, at::TensorOptions().dtype(o.dtype).device(e->device)));
    put(block, tensor_offset(o.slot), int64_t(reinterpret_cast<uintptr_t>(outs.back().data_ptr())));
  }
  // held until the launch is queued: freed after it, the caching allocator reuses it in stream order
  at::Tensor workspace;
  if (e->workspace_size) {
    workspace = at::empty({e->workspace_size}, at::TensorOptions().dtype(at::kByte).device(e->device));
    put(block, offsetof(coda::CallArgs, workspace), int64_t(reinterpret_cast<uintptr_t>(workspace.data_ptr())));
  }
  if (e->device.is_cuda()) {
    c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(e->device);
    put(block, offsetof(coda::CallArgs, stream), int64_t(reinterpret_cast<uintptr_t>(stream.native_handle())));
  }
  if (e->launch(reinterpret_cast<coda::CallArgs const*>(block.data()), self->message, kMessageBytes)) {
    PyObject* text = PyUnicode_DecodeUTF8(self->message, Py_ssize_t(std::strlen(self->message)), "replace");
    if (text) {
      PyErr_SetObject(kernel_error ? kernel_error : PyExc_RuntimeError, text);
      Py_DECREF(text);
    }
    return nullptr;
  }
  PyObject* result = PyDict_New();
  for (size_t i = 0; result && i < outs.size(); ++i) {
    PyObject* t = THPVariable_Wrap(std::move(outs[i]));
    if (!t || PyDict_SetItem(result, e->outputs[i].name, t) < 0) Py_CLEAR(result);
    Py_XDECREF(t);
  }
  return result;
  END_HANDLE_TH_ERRORS
}

// Reads a Python sequence of ints into `out` (at most `most` of them).
bool ints(PyObject* seq, std::vector<int64_t>& out, size_t most) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (!fast) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  bool ok = size_t(n) <= most;
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    out.push_back(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i)));
    ok = !PyErr_Occurred();
  }
  Py_DECREF(fast);
  if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "too many values");
  return ok;
}

at::Tensor const* tensor_arg(PyObject* v) {
  if (!THPVariable_Check(v)) {
    PyErr_SetString(PyExc_TypeError, "expected a tensor");
    return nullptr;
  }
  return &THPVariable_Unpack(v);
}

// Calls `each(item)` for every item of `seq`; false (with a Python error) as soon as one fails.
template <class Each>
bool for_each_item(PyObject* seq, Each&& each) {
  PyObject* it = PyObject_GetIter(seq);
  if (!it) return false;
  PyObject* item;
  bool ok = true;
  while (ok && (item = PyIter_Next(it))) {
    ok = each(item);
    Py_DECREF(item);
  }
  Py_DECREF(it);
  return ok && !PyErr_Occurred();
}

bool same_entry(Entry const& a, Entry const& b) {
  auto same_inputs = [](Input const& x, Input const& y) {
    return x.source == y.source && x.slot == y.slot && x.dtype == y.dtype && x.device == y.device &&
           x.dim == y.dim && x.align == y.align && std::equal(x.sizes, x.sizes + 3, y.sizes) &&
           std::equal(x.strides, x.strides + 3, y.strides);
  };
  auto same_outputs = [](Output const& x, Output const& y) {
    return x.slot == y.slot && x.dtype == y.dtype && x.sizes == y.sizes && PyUnicode_Compare(x.name, y.name) == 0;
  };
  auto same_consts = [](std::pair<int, double> const& x, std::pair<int, double> const& y) {
    return x.first == y.first && same_const(x.second, y.second);
  };
  return a.block == b.block && a.launch == b.launch && a.workspace_size == b.workspace_size &&
         a.device == b.device && a.scalars == b.scalars &&
         std::equal(a.inputs.begin(), a.inputs.end(), b.inputs.begin(), b.inputs.end(), same_inputs) &&
         std::equal(a.outputs.begin(), a.outputs.end(), b.outputs.begin(), b.outputs.end(), same_outputs) &&
         std::equal(a.consts.begin(), a.consts.end(), b.consts.begin(), b.consts.end(), same_consts);
}

// table.add(inputs, scalars, consts, outputs, block: bytes, workspace_size, launch: int) -> bool
//   inputs:  [(source, slot, tensor)]  the layout is read from the tensor
//   scalars: [(source, index)]; consts: [(source, value)]
//   outputs: [(name, sizes, like: a tensor of the output's dtype and device, slot)]
// True once the table has the layout (added now, or before); False where call() could not hold it
// (too many values). A malformed layout (a slot outside the block, one left empty) raises ValueError.
PyObject* table_add(Table* self, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *inputs, *scalars, *consts, *outputs;
  char const* block;
  Py_ssize_t block_size;
  long long workspace_size, launch;
  if (!PyArg_ParseTuple(args, "OOOOy#LL", &inputs, &scalars, &consts, &outputs, &block, &block_size, &workspace_size,
                        &launch))
    return nullptr;
  auto e = std::make_shared<Entry>();
  e->block.assign(block, size_t(block_size));
  e->workspace_size = workspace_size;
  e->launch = reinterpret_cast<Launch>(static_cast<uintptr_t>(launch));
  bool ok = for_each_item(inputs, [&](PyObject* item) {
    int source, slot;
    PyObject* tensor;
    if (!PyArg_ParseTuple(item, "iiO", &source, &slot, &tensor)) return false;
    at::Tensor const* t = tensor_arg(tensor);
    if (!t) return false;
    if (t->dim() > 3) {
      PyErr_SetString(PyExc_ValueError, "coda_warm.Table.add: a tensor of more than 3 dimensions");
      return false;
    }
    Input in{source, slot, t->scalar_type(), t->device(), t->dim(),
             int64_t(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16), {0, 0, 0}, {0, 0, 0}};
    for (int64_t i = 0; i < t->dim(); ++i) in.sizes[i] = t->sizes()[i], in.strides[i] = t->strides()[i];
    if (source == 0) e->device = t->device();
    e->inputs.push_back(in);
    return true;
  });
  ok = ok && for_each_item(scalars, [&](PyObject* item) {
    int source, index;
    if (!PyArg_ParseTuple(item, "ii", &source, &index)) return false;
    e->scalars.emplace_back(source, index);
    return true;
  });
  ok = ok && for_each_item(consts, [&](PyObject* item) {
    int source;
    double value;
    if (!PyArg_ParseTuple(item, "id", &source, &value)) return false;
    e->consts.emplace_back(source, value);
    return true;
  });
  ok = ok && for_each_item(outputs, [&](PyObject* item) {
    PyObject *name, *sizes, *like;
    int slot;
    std::vector<int64_t> shape;
    if (!PyArg_ParseTuple(item, "UOOi", &name, &sizes, &like, &slot) || !ints(sizes, shape, 3)) return false;
    at::Tensor const* t = tensor_arg(like);
    if (!t) return false;
    Py_INCREF(name);
    e->outputs.push_back(Output{name, std::move(shape), t->scalar_type(), slot});
    return true;
  });
  if (!ok) return nullptr;

  if (e->inputs.size() > kMostValues || e->scalars.size() > kMostValues || self->names->size() + 2 > kMostValues)
    Py_RETURN_FALSE;  // more than call()'s arrays hold: such calls take the Python path
  // Every slot of the block filled by exactly one tensor, every index inside the block.
  bool fits = e->block.size() >= sizeof(coda::CallArgs);
  if (fits) {
    auto const* header = reinterpret_cast<coda::CallArgs const*>(e->block.data());
    int64_t const n_tensors = header->n_tensors, n_scalars = header->n_scalars;
    fits = n_tensors >= 0 && n_scalars >= 0 &&
           e->block.size() == tensor_offset(int(n_tensors)) + sizeof(double) * size_t(n_scalars);
    std::vector<int> filled(size_t(std::max<int64_t>(n_tensors, 0)), 0);
    auto source_ok = [&](int v) { return v >= 0 && size_t(v) < 2 + self->names->size(); };
    auto fill = [&](int slot) { return slot >= 0 && slot < n_tensors && ++filled[size_t(slot)] == 1; };
    for (Input const& in : e->inputs) fits = fits && source_ok(in.source) && (in.slot == -1 || fill(in.slot));
    for (Output const& o : e->outputs) fits = fits && fill(o.slot);
    for (int f : filled) fits = fits && f == 1;
    for (auto const& [source, index] : e->scalars) fits = fits && source_ok(source) && index >= -1 && index < n_scalars;
    for (auto const& c : e->consts) fits = fits && source_ok(c.first);
  }
  if (!fits) {
    PyErr_SetString(PyExc_ValueError, "coda_warm.Table.add: the layout's slots do not fill its argument block");
    return nullptr;
  }
  auto& entries = *self->entries;
  for (auto const& old : entries)
    if (same_entry(*old, *e)) Py_RETURN_TRUE;  // offered again (its calls missed for other reasons)
  if (entries.size() >= kMostEntries) entries.erase(entries.begin());
  entries.push_back(std::move(e));
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyObject* table_clear(Table* self, PyObject*) {
  Entries gone;
  gone.swap(*self->entries);  // released after the table is consistent again
  Py_RETURN_NONE;
}

PyObject* table_len(Table* self, PyObject*) { return PyLong_FromSize_t(self->entries->size()); }

PyObject* table_new(PyTypeObject* type, PyObject* args, PyObject*) {
  PyObject* names;
  if (!PyArg_ParseTuple(args, "O", &names)) return nullptr;
  PyObject* fast = PySequence_Fast(names, "Table(names): a sequence of operand names");
  if (!fast) return nullptr;
  auto* self = reinterpret_cast<Table*>(type->tp_alloc(type, 0));
  if (!self) {
    Py_DECREF(fast);
    return nullptr;
  }
  self->names = new std::vector<PyObject*>();
  self->entries = new Entries();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PyObject* name = PySequence_Fast_GET_ITEM(fast, i);
    Py_INCREF(name);
    self->names->push_back(name);
  }
  Py_DECREF(fast);
  return reinterpret_cast<PyObject*>(self);
}

void table_dealloc(Table* self) {
  delete self->entries;  // each entry releases its names
  if (self->names) {
    for (PyObject* n : *self->names) Py_DECREF(n);
    delete self->names;
  }
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyMethodDef table_methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table_call)), METH_FASTCALL,
     "call(A, B, operands) -> {output: tensor}, or None if no layout of the table matches"},
    {"add", reinterpret_cast<PyCFunction>(table_add), METH_VARARGS, "add a checked layout (runtime/warm.py)"},
    {"clear", reinterpret_cast<PyCFunction>(table_clear), METH_NOARGS, "forget every layout"},
    {"size", reinterpret_cast<PyCFunction>(table_len), METH_NOARGS, "the number of layouts"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject table_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* set_error_type(PyObject*, PyObject* type) {
  Py_XINCREF(type);
  Py_XDECREF(kernel_error);
  kernel_error = type;
  Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"set_error_type", set_error_type, METH_O, "the exception a failed launch raises"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "coda_warm", "coda_dsl's warm call path", -1, module_methods};

}  // namespace

PyMODINIT_FUNC PyInit_coda_warm() {
  table_type.tp_name = "coda_warm.Table";
  table_type.tp_basicsize = sizeof(Table);
  table_type.tp_flags = Py_TPFLAGS_DEFAULT;
  table_type.tp_new = table_new;
  table_type.tp_dealloc = reinterpret_cast<destructor>(table_dealloc);
  table_type.tp_methods = table_methods;
  table_type.tp_doc = "call layouts checked by the Python path, launched without it";
  if (PyType_Ready(&table_type) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (!m) return nullptr;
  Py_INCREF(&table_type);
  if (PyModule_AddObject(m, "Table", reinterpret_cast<PyObject*>(&table_type)) < 0) {
    Py_DECREF(&table_type);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
