// Cotangent's tensor-list reader: checks a single-pass call's tensor lists and reads their
// addresses in one C++ loop, through the Python objects (no reference counting, no Python
// attribute lookups). Built and loaded by cotangent/tensorlists.py; the rules it checks are
// those of `singlepass.prepare_lists`'s contiguous case, which is the reference (that Python
// code runs wherever this returns 0, and says why a list is refused).
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// The two Python types whose objects are read here (torch.Tensor, torch.nn.Parameter: neither
// overrides __torch_function__); any other type is left to the Python checks.
PyTypeObject* tensor_type = nullptr;
PyTypeObject* parameter_type = nullptr;

// The tensor behind `obj`, or nullptr when it is not a plain dense CPU tensor with storage
// that the kernel may read through its address (subclasses, inference tensors, negated or
// conjugated views, ZeroTensors and meta tensors are left to the Python checks).
const at::Tensor* plain_cpu(PyObject* obj) {
  if (Py_TYPE(obj) != tensor_type && Py_TYPE(obj) != parameter_type) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != c10::kStrided || !t.is_cpu()) return nullptr;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->is_python_dispatch() || !t.has_storage() || t.is_inference() || t.is_neg() ||
      t.is_conj() || t._is_zerotensor() || (t.data_ptr() == nullptr && t.numel() > 0)) {
    return nullptr;
  }
  return &t;
}

// Whether `p` (a torch.Tensor or nn.Parameter object) is a leaf, whose ``.grad`` C++ reads as
// Python does (a non-leaf's read warns natively, through Python: left to Python).
bool leaf(PyObject* p) { return THPVariable_Unpack(p).grad_fn() == nullptr; }

bool disjoint(std::vector<std::pair<int64_t, int64_t>>& spans) {
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); i++) {
    if (spans[i].first < spans[i - 1].second) return false;
  }
  return true;
}

}  // namespace

// `lists`: K >= 1 Python lists of n tensors each (torch.Tensor or torch.nn.Parameter objects) (parameters first, then gradient, exp_avg,
// exp_avg_sq[, max_exp_avg_sq]); `steps`: a Python list of n step tensors; `out`: a writable
// contiguous int64 buffer (format "q", e.g. array.array("q")) of (K + 2) * n entries. Where every tensor of `lists` is contiguous, of the
// parameters' dtype and its parameter's sizes, on the CPU, no parameter requires grad while
// `grad_enabled`, and the step tensors are distinct 0-d CPU tensors: fills row k (k < K) with
// the k-th list's data pointers, row K with the steps' and row K + 1 with the parameters'
// numels, and returns 1 | 2 (every step tensor float32) | 4 (no two of these tensors' byte
// spans overlap). Otherwise returns 0 and `out` is unspecified.
int64_t read_lists(py::list lists, py::list steps, bool grad_enabled, py::buffer out) {
  if (tensor_type == nullptr) return 0;
  py::buffer_info info = out.request(true);
  const Py_ssize_t kinds = PyList_GET_SIZE(lists.ptr());
  const Py_ssize_t n = PyList_GET_SIZE(steps.ptr());
  if (kinds < 1 || info.ndim != 1 || info.format != py::format_descriptor<int64_t>::format() ||
      info.itemsize != 8 || info.strides[0] != 8 || info.shape[0] != (kinds + 2) * n) {
    return 0;
  }
  int64_t* table = static_cast<int64_t*>(info.ptr);
  std::vector<const at::Tensor*> params(n);
  std::vector<std::pair<int64_t, int64_t>> spans;
  spans.reserve((kinds + 1) * n);
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  for (Py_ssize_t k = 0; k < kinds; k++) {
    PyObject* list = PyList_GET_ITEM(lists.ptr(), k);
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
      const at::Tensor* t = plain_cpu(PyList_GET_ITEM(list, i));
      if (t == nullptr) return 0;
      if (k == 0) {
        if (i == 0) dtype = t->scalar_type();
        if (grad_enabled && t->requires_grad()) return 0;
        params[i] = t;
      }
      if (t->scalar_type() != dtype || !t->is_contiguous() ||
          t->sizes() != params[i]->sizes()) {
        return 0;
      }
      const int64_t address = reinterpret_cast<int64_t>(t->data_ptr());
      table[k * n + i] = address;
      spans.emplace_back(address, address + t->numel() * static_cast<int64_t>(t->itemsize()));
    }
  }
  bool float32_steps = true;
  std::vector<const c10::TensorImpl*> impls(n);
  for (Py_ssize_t i = 0; i < n; i++) {
    const at::Tensor* s = plain_cpu(PyList_GET_ITEM(steps.ptr(), i));
    if (s == nullptr || s->dim() != 0) return 0;
    impls[i] = s->unsafeGetTensorImpl();
    float32_steps = float32_steps && s->scalar_type() == c10::ScalarType::Float;
    const int64_t address = reinterpret_cast<int64_t>(s->data_ptr());
    table[kinds * n + i] = address;
    spans.emplace_back(address, address + static_cast<int64_t>(s->itemsize()));
    table[(kinds + 1) * n + i] = params[i]->numel();
  }
  std::sort(impls.begin(), impls.end());
  if (std::adjacent_find(impls.begin(), impls.end()) != impls.end()) return 0;
  spans.erase(std::remove_if(spans.begin(), spans.end(),
                             [](const std::pair<int64_t, int64_t>& s) {
                               return s.second == s.first;
                             }),
              spans.end());
  return 1 | (float32_steps ? 2 : 0) | (disjoint(spans) ? 4 : 0);
}

namespace {

// One state entry's tensor, or nullptr (absent, or an object of another type than
// torch.Tensor exactly: native's state holds plain tensors; anything else is left to the
// Python checks).
PyObject* state_tensor(PyObject* entry, PyObject* key) {
  PyObject* t = PyDict_GetItemWithError(entry, key);  // borrowed
  if (t == nullptr || Py_TYPE(t) != tensor_type) return nullptr;
  return t;
}

// `state.get(p)` for a torch.Tensor or nn.Parameter `p` (whose hash is id(p): checked when
// the types are set), without calling Tensor.__hash__ through Python where the interpreter
// offers the lookup by a known hash.
PyObject* state_entry(PyObject* state, PyObject* p, bool hash_is_id) {
#if PY_VERSION_HEX < 0x030D0000
  if (hash_is_id) {
    return _PyDict_GetItem_KnownHash(state, p,
                                     static_cast<Py_hash_t>(reinterpret_cast<intptr_t>(p)));
  }
#endif
  return PyDict_GetItemWithError(state, p);
}

// Tensor.__hash__ as it was when the types were set (`set_types`, whose caller checked that
// it returns id(self)); a hash looked up by id is used only while both types still have it.
PyObject* tensor_hash = nullptr;

bool hash_is_id() {
  if (tensor_hash == nullptr) return false;
  bool same = true;
  for (PyTypeObject* type : {tensor_type, parameter_type}) {
    PyObject* h = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__hash__");
    if (h == nullptr) {
      PyErr_Clear();
      return false;
    }
    same = same && h == tensor_hash;
    Py_DECREF(h);
  }
  return same;
}

PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;
}

// Touch what `read_group` reads, a level at a time over all parameters (each level's loads are
// independent of one another, so the processor overlaps their cache misses, where one
// parameter after another would wait for each in turn): after a backward most of these
// objects are out of the caches. Reads only; declines nothing (the checks follow).
void touch(const void* address, int lines) {
  for (int i = 0; i < lines; i++) __builtin_prefetch(static_cast<const char*>(address) + 64 * i);
}

void prefetch_group(PyObject* list, PyObject* state, bool by_id, bool amsgrad) {
  const Py_ssize_t count = PyList_GET_SIZE(list);
  std::vector<PyObject*> objects;
  objects.reserve(count);
  for (Py_ssize_t i = 0; i < count; i++) touch(PyList_GET_ITEM(list, i), 1);
  std::vector<c10::TensorImpl*> impls;
  impls.reserve(count);
  for (Py_ssize_t i = 0; i < count; i++) {
    PyObject* p = PyList_GET_ITEM(list, i);
    if ((Py_TYPE(p) != tensor_type && Py_TYPE(p) != parameter_type) || !leaf(p)) return;
    impls.push_back(THPVariable_Unpack(p).unsafeGetTensorImpl());
    touch(impls.back(), 4);
  }
  for (c10::TensorImpl* impl : impls) touch(impl->autograd_meta(), 2);
  std::vector<c10::TensorImpl*> grads;
  grads.reserve(count);
  for (Py_ssize_t i = 0; i < count; i++) {
    const at::Tensor& g = THPVariable_Unpack(PyList_GET_ITEM(list, i)).grad();
    if (g.defined()) {
      grads.push_back(g.unsafeGetTensorImpl());
      touch(grads.back(), 4);
    }
  }
  if (!by_id) return;  // (a lookup through Python's hash: not while prefetching)
  std::vector<PyObject*> entries;
  entries.reserve(count);
  for (Py_ssize_t i = 0; i < count; i++) {
    PyObject* entry = state_entry(state, PyList_GET_ITEM(list, i), true);
    if (entry == nullptr) {
      PyErr_Clear();
      continue;
    }
    if (PyDict_CheckExact(entry)) {
      entries.push_back(entry);
      touch(reinterpret_cast<PyDictObject*>(entry)->ma_keys, 3);
    }
  }
  static PyObject* names[4] = {PyUnicode_InternFromString("exp_avg"),
                               PyUnicode_InternFromString("exp_avg_sq"),
                               PyUnicode_InternFromString("step"),
                               PyUnicode_InternFromString("max_exp_avg_sq")};
  for (PyObject* entry : entries) {
    for (int k = 0; k < (amsgrad ? 4 : 3); k++) {
      PyObject* t = PyDict_GetItemWithError(entry, names[k]);
      if (t == nullptr) {
        PyErr_Clear();
      } else {
        objects.push_back(t);
        touch(t, 1);
      }
    }
  }
  for (PyObject* t : objects) {
    if (Py_TYPE(t) == tensor_type || Py_TYPE(t) == parameter_type) {
      impls.push_back(THPVariable_Unpack(t).unsafeGetTensorImpl());
      touch(impls.back(), 4);
    }
  }
  impls.insert(impls.end(), grads.begin(), grads.end());
  for (c10::TensorImpl* impl : impls) {  // (where each tensor's data address is read)
    if (impl->has_storage()) touch(impl->unsafe_storage().unsafeGetStorageImpl(), 1);
  }
}

}  // namespace

// One param group's AdamW lists as `cotangent.gather` reads them, checked in one C++ loop:
// `params` is the group's parameter list, `state` the optimizer's state dict. The parameters
// with a gradient (`p.grad is not None`) are the call's, in group order. Returns None unless
// every parameter is a plain CPU tensor (see `plain_cpu`) and a leaf, and every one with a
// gradient is dense, contiguous, of one dtype, not requiring grad while `grad_enabled`, whose
// gradient is such a tensor of its dtype and sizes and whose state entry is a dict holding
// "exp_avg", "exp_avg_sq" (and "max_exp_avg_sq" with `amsgrad`), torch.Tensor objects of its
// dtype and sizes, and a "step" that is a 0-d plain CPU tensor of its own, and no two of them
// share a gradient object or a step tensor; otherwise the caller reads the group in Python
// (the reference, with its errors). Else a tuple (flags, pos, params, grads, exp_avgs,
// exp_avg_sqs, max_exp_avg_sqs, steps, table): flags = 1 | 2 (every step tensor float32) |
// 4 (no two byte spans overlap); pos the parameters' indices in `params`; the lists
// (max_exp_avg_sqs empty without `amsgrad`); table a bytearray of int64 rows of n entries
// each: the addresses of each list's tensors (params, grads, exp_avgs, exp_avg_sqs[,
// max_exp_avg_sqs]), of the step tensors, then the parameters' numels
// (`cotangent.singlepass.Prepared.table`).
py::object read_group(py::list params, py::object state, bool amsgrad, bool grad_enabled) {
  static PyObject* k_exp_avg = interned("exp_avg");
  static PyObject* k_exp_avg_sq = interned("exp_avg_sq");
  static PyObject* k_max = interned("max_exp_avg_sq");
  static PyObject* k_step = interned("step");
  if (tensor_type == nullptr || !PyDict_Check(state.ptr())) return py::none();
  const bool by_id = hash_is_id();
  const Py_ssize_t count = PyList_GET_SIZE(params.ptr());
  const int kinds = amsgrad ? 5 : 4;
  prefetch_group(params.ptr(), state.ptr(), by_id, amsgrad);
  // params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps: borrowed references (the
  // group's list and the state dict hold them during the call), but the gradients' (new ones)
  std::vector<PyObject*> objs[6];
  std::vector<py::object> grads;
  std::vector<const at::Tensor*> tensors[6];
  std::vector<Py_ssize_t> pos;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  for (Py_ssize_t i = 0; i < count; i++) {
    PyObject* p = PyList_GET_ITEM(params.ptr(), i);
    const at::Tensor* pt = plain_cpu(p);
    if (pt == nullptr || !leaf(p)) return py::none();
    const at::Tensor& grad = pt->grad();
    if (!grad.defined()) continue;
    if (pos.empty()) dtype = pt->scalar_type();
    if (pt->scalar_type() != dtype || !pt->is_contiguous() ||
        (grad_enabled && pt->requires_grad())) {
      return py::none();
    }
    grads.push_back(py::reinterpret_steal<py::object>(THPVariable_Wrap(grad)));
    PyObject* g = grads.back().ptr();
    if (g == nullptr) throw py::error_already_set();
    PyObject* entry = state_entry(state.ptr(), p, by_id);
    if (entry == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return py::none();
    }
    if (!PyDict_CheckExact(entry)) return py::none();  // (a subclass may override get)
    PyObject* found[6] = {p, g, state_tensor(entry, k_exp_avg),
                          state_tensor(entry, k_exp_avg_sq),
                          amsgrad ? state_tensor(entry, k_max) : Py_None, nullptr};
    PyObject* step = PyDict_GetItemWithError(entry, k_step);
    if (PyErr_Occurred()) throw py::error_already_set();
    found[5] = step;
    for (int k = 0; k < 6; k++) {
      if (found[k] == nullptr) return py::none();
      if (k == 4 && !amsgrad) continue;
      const at::Tensor* t = k == 0 ? pt : plain_cpu(found[k]);
      if (t == nullptr) return py::none();
      if (k == 5) {
        if (t->dim() != 0) return py::none();
      } else if (t->scalar_type() != dtype || !t->is_contiguous() || t->sizes() != pt->sizes()) {
        return py::none();
      }
      tensors[k].push_back(t);
      objs[k].push_back(found[k]);
    }
    pos.push_back(i);
  }
  const size_t n = pos.size();
  py::bytearray table(nullptr, 0);
  if (PyByteArray_Resize(table.ptr(), static_cast<Py_ssize_t>(8 * (kinds + 2) * n)) != 0) {
    throw py::error_already_set();
  }
  int64_t* row = reinterpret_cast<int64_t*>(PyByteArray_AS_STRING(table.ptr()));
  std::vector<std::pair<int64_t, int64_t>> spans;
  spans.reserve((kinds + 1) * n);
  bool float32_steps = true;
  std::vector<const c10::TensorImpl*> impls(n);
  for (int k = 0; k < 6; k++) {
    if (k == 4 && !amsgrad) continue;
    for (size_t i = 0; i < n; i++) {
      const at::Tensor* t = tensors[k][i];
      const int64_t address = reinterpret_cast<int64_t>(t->data_ptr());
      *row++ = address;
      spans.emplace_back(address, address + t->numel() * static_cast<int64_t>(t->itemsize()));
      if (k == 5) {
        impls[i] = t->unsafeGetTensorImpl();
        float32_steps = float32_steps && t->scalar_type() == c10::ScalarType::Float;
      }
    }
  }
  for (size_t i = 0; i < n; i++) *row++ = tensors[0][i]->numel();
  std::sort(impls.begin(), impls.end());
  if (std::adjacent_find(impls.begin(), impls.end()) != impls.end()) return py::none();
  std::vector<PyObject*> distinct(objs[1]);  // (one gradient object for two parameters: the
  std::sort(distinct.begin(), distinct.end());  // Python path, whose clip multiplies it twice)
  if (std::adjacent_find(distinct.begin(), distinct.end()) != distinct.end()) return py::none();
  spans.erase(std::remove_if(spans.begin(), spans.end(),
                             [](const std::pair<int64_t, int64_t>& s) {
                               return s.second == s.first;
                             }),
              spans.end());
  py::list out[6];
  for (int k = 0; k < 6; k++) {
    out[k] = py::list(objs[k].size());
    for (size_t i = 0; i < objs[k].size(); i++) {
      Py_INCREF(objs[k][i]);
      PyList_SET_ITEM(out[k].ptr(), i, objs[k][i]);
    }
  }
  py::list positions(n);
  for (size_t i = 0; i < n; i++) {
    PyList_SET_ITEM(positions.ptr(), i, PyLong_FromSsize_t(pos[i]));
  }
  const int flags = 1 | (float32_steps ? 2 : 0) | (disjoint(spans) ? 4 : 0);
  return py::make_tuple(flags, positions, out[0], out[1], out[2], out[3], out[4], out[5], table);
}

// The gradients a clip saw (`cotangent.clip.ClipRecord`), in order, held by weak reference
// to their tensors: a gradient freed by zero_grad releases its memory as without the record,
// and while the record lives no other tensor can have its address, so an equal address is
// the same tensor (as ``is`` tells of their Python objects, one per tensor).
class GradientSet {
 public:
  explicit GradientSet(py::list grads) {
    const Py_ssize_t n = PyList_GET_SIZE(grads.ptr());
    held_.reserve(n);
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* g = PyList_GET_ITEM(grads.ptr(), i);
      if (!THPVariable_Check(g)) throw py::type_error("GradientSet holds tensors only");
      held_.emplace_back(THPVariable_Unpack(g).getIntrusivePtr());
      order_.push_back(held_.back()._unsafe_get_target());
    }
    sorted_ = order_;
    std::sort(sorted_.begin(), sorted_.end());
  }

  size_t size() const { return order_.size(); }

  // Whether `tensors` are these gradients, the same tensors in the same order.
  bool same(py::list tensors) const {
    const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
    if (static_cast<size_t>(n) != order_.size()) return false;
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* t = PyList_GET_ITEM(tensors.ptr(), i);
      if (!THPVariable_Check(t) || THPVariable_Unpack(t).unsafeGetTensorImpl() != order_[i]) {
        return false;
      }
    }
    return true;
  }

  // Whether `tensor` is one of these gradients.
  bool holds(py::handle tensor) const {
    return THPVariable_Check(tensor.ptr()) &&
           std::binary_search(sorted_.begin(), sorted_.end(),
                              THPVariable_Unpack(tensor.ptr()).unsafeGetTensorImpl());
  }

  // 1 when the `.grad` of every parameter in `params` that has one is one of these gradients,
  // 0 when one is another tensor, -1 when a parameter is not a torch.Tensor or nn.Parameter
  // leaf (whose ``.grad`` could run Python code or warn, or be a DTensor whose local shard was
  // clipped: the caller asks `holds` of each).
  int covers(py::list params) const {
    const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* p = PyList_GET_ITEM(params.ptr(), i);
      if ((Py_TYPE(p) != tensor_type && Py_TYPE(p) != parameter_type) || !leaf(p)) return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
      const at::Tensor& g = THPVariable_Unpack(PyList_GET_ITEM(params.ptr(), i)).grad();
      if (g.defined() &&
          !std::binary_search(sorted_.begin(), sorted_.end(), g.unsafeGetTensorImpl())) {
        return 0;
      }
    }
    return 1;
  }

 private:
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> held_;
  std::vector<c10::TensorImpl*> order_, sorted_;
};

// `Optimizer.zero_grad(set_to_none=True)`'s loop (``p.grad = None`` for every parameter of every
// group whose gradient is not None) over `groups` (``param_groups``: a list of dicts whose
// "params" are lists), as the ``grad`` setter does it (`mutable_grad().reset()`). Only where
// every parameter is a torch.Tensor or nn.Parameter (no __torch_function__ of its own) and a
// leaf (a non-leaf's ``.grad`` read warns natively); otherwise returns false having changed
// nothing, and the caller runs torch's own loop.
bool clear_grads(py::list groups) {
  if (tensor_type == nullptr) return false;
  static PyObject* k_params = PyUnicode_InternFromString("params");
  const Py_ssize_t count = PyList_GET_SIZE(groups.ptr());
  for (int pass = 0; pass < 2; pass++) {
    for (Py_ssize_t g = 0; g < count; g++) {
      PyObject* group = PyList_GET_ITEM(groups.ptr(), g);
      if (!PyDict_CheckExact(group)) return false;
      PyObject* params = PyDict_GetItemWithError(group, k_params);
      if (params == nullptr) {
        PyErr_Clear();
        return false;
      }
      if (!PyList_CheckExact(params)) return false;
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
        PyObject* p = PyList_GET_ITEM(params, i);
        if (pass == 0) {
          if (Py_TYPE(p) != tensor_type && Py_TYPE(p) != parameter_type) return false;
          if (THPVariable_Unpack(p).grad_fn() != nullptr) return false;
        } else {
          THPVariable_Unpack(p).mutable_grad().reset();
        }
      }
    }
  }
  return true;
}

// ---- The last step replayed (`cotangent.replay`): one param group read whole, its clip and
// its single pass, with the decisions of the full step that built the plan, where every input
// of those decisions is as it was then; otherwise nothing is modified and the caller runs the
// full step.

using norms_team_fn = void (*)(const int64_t*, const int64_t*, int64_t, float*, int, int*);
using clip_scalars_fn = void (*)(const float*, int64_t, double, float*, float*);
using team_fn = int (*)(int, int*);
using adamw_fn = int (*)(float* const*, float* const*, float* const*, float* const*,
                         float* const*, const int64_t*, int64_t, const double*, const double*,
                         double, double, double, double, double, int, void*, long long, int,
                         double);

// `cotangent.singlepass.scalar_class` of a double rounded to float32 (as ATen receives a
// Python scalar): 0 "nan", 1 "+inf", 2 "-inf", 3 "+0", 4 "-0", 5 "+sub", 6 "-sub", 7 "+", 8 "-"
int scalar_class(double x) {
  const float f = static_cast<float>(x);
  if (f != f) return 0;
  const bool neg = std::signbit(f);
  if (std::isinf(f)) return neg ? 2 : 1;
  if (f == 0.0f) return neg ? 4 : 3;
  if (std::fabs(f) < FLT_MIN) return neg ? 6 : 5;
  return neg ? 8 : 7;
}

// Whether `a` holds what `b` held when the plan was made: the same float bits, the same int,
// bool or None, or sequences of such, element by element (a list edited in place is read
// anew).
bool same_value(PyObject* a, PyObject* b) {
  if (PyFloat_CheckExact(a) && PyFloat_CheckExact(b)) {
    const double x = PyFloat_AS_DOUBLE(a), y = PyFloat_AS_DOUBLE(b);
    return std::memcmp(&x, &y, sizeof x) == 0;
  }
  if (a == Py_None || b == Py_None || PyBool_Check(a) || PyBool_Check(b)) return a == b;
  if (PyLong_CheckExact(a) && PyLong_CheckExact(b)) {
    return PyObject_RichCompareBool(a, b, Py_EQ) == 1;
  }
  if ((PyTuple_CheckExact(a) || PyList_CheckExact(a)) && PyTuple_CheckExact(b)) {
    PyObject* seq = PySequence_Fast(a, "");
    if (seq == nullptr) {
      PyErr_Clear();
      return false;
    }
    bool same = PySequence_Fast_GET_SIZE(seq) == PyTuple_GET_SIZE(b);
    for (Py_ssize_t i = 0; same && i < PyTuple_GET_SIZE(b); i++) {
      same = same_value(PySequence_Fast_GET_ITEM(seq, i), PyTuple_GET_ITEM(b, i));
    }
    Py_DECREF(seq);
    return same;
  }
  return false;
}

class Replay {
 public:
  // `group`: the param group; `snapshot`: (key, value) pairs of the group's settings as the
  // plan's step read them (lr apart: it may change from step to step, its class may not);
  // `plan`: the rest (see `cotangent.replay.Plan.compiled`).
  Replay(py::dict group, py::tuple snapshot, py::dict plan) : group_(group) {
    for (py::handle item : snapshot) {
      py::tuple kv = item.cast<py::tuple>();
      keys_.push_back(py::reinterpret_borrow<py::object>(kv[0]));
      values_.push_back(py::reinterpret_borrow<py::object>(kv[1]));
    }
    kind_ = plan["kind"].cast<int>();
    amsgrad_ = plan["amsgrad"].cast<bool>();
    clip_ = plan["clip"].cast<bool>();
    error_if_nonfinite_ = plan["error_if_nonfinite"].cast<bool>();
    max_norm_ = plan["max_norm"].cast<double>();
    beta1_ = plan["beta1"].cast<double>();
    beta2_ = plan["beta2"].cast<double>();
    weight_decay_ = plan["weight_decay"].cast<double>();
    lr_class_ = scalar_class(plan["lr"].cast<double>());
    decay_class_ = scalar_class(decay_of(plan["lr"].cast<double>()));
    scalars_ = plan["scalars"].cast<std::vector<double>>();  // 1 - beta1, beta2, 1 - beta2, eps
    flags_ = plan["flags"].cast<int>();
    sqrt_fn_ = reinterpret_cast<void*>(plan["sqrt_fn"].cast<intptr_t>());
    sqrt_mode_ = plan["sqrt_mode"].cast<long long>();
    threads_ = plan["threads"].cast<int>();
    team_size_ = plan["team_size"].cast<int>();
    team_modes_ = plan["team_modes"].cast<std::vector<int>>();
    numels_ = plan["numels"].cast<std::vector<int64_t>>();
    pieces_ = plan["pieces"].cast<at::Tensor>();
    norms_team_ = reinterpret_cast<norms_team_fn>(plan["norms_team_fn"].cast<intptr_t>());
    clip_scalars_ = reinterpret_cast<clip_scalars_fn>(plan["clip_scalars_fn"].cast<intptr_t>());
    team_ = reinterpret_cast<team_fn>(plan["team_fn"].cast<intptr_t>());
    adamw_ = reinterpret_cast<adamw_fn>(plan["adamw_fn"].cast<intptr_t>());
    for (int& verdict : known_) verdict = -1;
  }

  // The step, or None having modified nothing. `state`: the optimizer's state dict;
  // `decide(coef)`: whether the single pass may take the update with the clip multiply by
  // `coef` (None: without it), asked once per class of coefficient (the full step's
  // `Step.decide`). Returns (total norm, the clipped gradients as a `GradientSet`, parameters
  // updated, clip in pass) with the clip, else (None, None, parameters updated, False).
  py::object run(py::object state, py::object decide) {
    // 1. the settings as planned
    if (at::get_num_threads() != threads_ || !group_unchanged()) return py::none();
    PyObject* lr_obj = PyDict_GetItemString(group_.ptr(), "lr");
    if (lr_obj == nullptr || !PyFloat_CheckExact(lr_obj)) return py::none();
    const double lr = PyFloat_AS_DOUBLE(lr_obj);
    const double decay = decay_of(lr);
    if (scalar_class(lr) != lr_class_ || scalar_class(decay) != decay_class_ ||
        decay != decay || (std::isfinite(decay) && std::fabs(decay) > FLT_MAX)) {
      return py::none();
    }
    // 2. the lists, read and checked
    py::object params = py::reinterpret_borrow<py::object>(
        PyDict_GetItemString(group_.ptr(), "params"));
    if (!params || !PyList_CheckExact(params.ptr())) return py::none();
    py::object read = read_group(params.cast<py::list>(), state, amsgrad_,
                                 at::GradMode::is_enabled());
    if (read.is_none()) return py::none();
    py::tuple got = read.cast<py::tuple>();
    const int flags = got[0].cast<int>();
    py::list grads = got[3].cast<py::list>(), steps = got[7].cast<py::list>();
    const size_t n = PyList_GET_SIZE(grads.ptr());
    if ((flags & 6) != 6 || n != numels_.size() || n == 0 ||
        THPVariable_Unpack(PyList_GET_ITEM(got[2].ptr(), 0)).scalar_type() != at::kFloat) {
      return py::none();  // (shared memory, other steps, other lists: the full step decides)
    }
    PyObject* raw = got[8].ptr();
    const int64_t* table = reinterpret_cast<const int64_t*>(PyByteArray_AS_STRING(raw));
    const int kinds = amsgrad_ ? 5 : 4;
    if (!std::equal(numels_.begin(), numels_.end(), table + (kinds + 1) * n)) return py::none();
    // 3. the clip: norms and team in one region, the total and coefficient as clip_grad_norm_
    // (`singlepass.clip_scalars`; the plan holds where the norm probe proved both)
    std::vector<int> team(threads_ + 1, 0);
    py::object total = py::none();
    double value = 0.0;
    bool clip_in_pass = false, identity = false;
    if (clip_) {
      at::Tensor norms = at::empty({static_cast<int64_t>(n)}, at::kFloat);
      norms_team_(table + n, table + (kinds + 1) * n, n, norms.data_ptr<float>(), threads_,
                  team.data());
      if (!same_team(team)) return py::none();
      at::Tensor t = at::empty({}, at::kFloat), c = at::empty({}, at::kFloat);
      clip_scalars_(norms.data_ptr<float>(), n, max_norm_, t.data_ptr<float>(),
                    c.data_ptr<float>());
      value = *c.data_ptr<float>();
      if (error_if_nonfinite_ && !std::isfinite(*t.data_ptr<float>())) {
        return py::none();  // (the full step raises native's error)
      }
      total = py::cast(t);
      identity = value == 1.0 && !(team_modes_[0] & 0x8040);
      if (value != value ||
          (!identity && !allowed(scalar_class(value), decide, py::float_(value)))) {
        return py::none();  // (a NaN coefficient, or a class the pass may not fold)
      }
      clip_in_pass = !identity;
    } else {
      team[0] = team_(threads_, team.data() + 1);
      if (!same_team(team)) return py::none();
    }
    if (!clip_in_pass && !allowed(kNoClip, decide, py::none())) return py::none();
    // 4. the steps: native's scalars for each distinct step value
    std::vector<double> nstep(n), bc2s(n);
    std::vector<float> stepped(n);
    double last_t = -1.0, last_a = 0.0, last_b = 0.0;
    for (size_t i = 0; i < n; i++) {
      stepped[i] = *reinterpret_cast<const float*>(table[kinds * n + i]) + 1.0f;
      const double t = stepped[i];
      if (t != last_t) {
        if (!step_scalars(t, lr, &last_a, &last_b)) return py::none();
        last_t = t;
      }
      nstep[i] = last_a;
      bc2s[i] = last_b;
    }
    // 5. from here on the step is the plan's: steps, the pass, the version counters
    for (size_t i = 0; i < n; i++) *reinterpret_cast<float*>(table[kinds * n + i]) = stepped[i];
    bump(steps);
    float* const* rows = reinterpret_cast<float* const*>(table);
    adamw_(const_cast<float* const*>(rows), rows + n, rows + 2 * n, rows + 3 * n,
           amsgrad_ ? rows + 4 * n : nullptr, pieces_.data_ptr<int64_t>(), pieces_.size(0),
           nstep.data(), bc2s.data(), decay, scalars_[0], scalars_[1], scalars_[2],
           scalars_[3], flags_ | (clip_in_pass ? 8 : 0), sqrt_fn_, sqrt_mode_, threads_,
           clip_in_pass ? value : 0.0);
    if (clip_) bump(grads);  // (the clip multiply, or native's multiply by exactly 1.0)
    if (kind_ != 2) {  // for-loop and foreach: each in-place op's bump (`update.bump_versions`)
      py::list params_list = got[2].cast<py::list>(), m = got[4].cast<py::list>(),
               v = got[5].cast<py::list>();
      bump(params_list);
      bump(m);
      bump(v);
      bump(v);
      if (amsgrad_) bump(got[6].cast<py::list>());
      if (weight_decay_ != 0) bump(params_list);
    }
    return py::make_tuple(total, clip_ ? py::cast(GradientSet(grads)) : py::none(),
                          static_cast<int64_t>(n), clip_in_pass);
  }

 private:
  static constexpr int kNoClip = 9;

  // Python's ``1 - lr * weight_decay`` (1.0 without decay), as `_launch` computes it.
  double decay_of(double lr) const { return weight_decay_ != 0 ? 1 - lr * weight_decay_ : 1.0; }

  bool group_unchanged() const {
    for (size_t i = 0; i < keys_.size(); i++) {
      PyObject* now = PyDict_GetItemWithError(group_.ptr(), keys_[i].ptr());
      if (now == nullptr) {
        PyErr_Clear();
        return false;
      }
      if (!same_value(now, values_[i].ptr())) return false;
    }
    return true;
  }

  bool same_team(const std::vector<int>& team) const {
    if (team[0] != team_size_) return false;
    for (int i = 0; i < team_size_; i++) {
      if ((team[1 + i] & 0xFFC0) != team_modes_[i]) return false;
    }
    return true;
  }

  // The verdict for `slot` (a coefficient class, or kNoClip), asked of `decide` once.
  bool allowed(int slot, py::object decide, py::object coef) {
    if (known_[slot] < 0) known_[slot] = decide(coef).cast<bool>() ? 1 : 0;
    return known_[slot] == 1;
  }

  // `cotangent.singlepass.native_step_scalars` at step `t` (Python's float arithmetic: libm's
  // pow as float.__pow__ calls it for these arguments), false where native would raise or the
  // kernel refuses (a zero bias correction, NaN, beyond float32).
  bool step_scalars(double t, double lr, double* a, double* b) const {
    if (!(t >= 1.0) || !std::isfinite(t) || !(beta1_ >= 0.0 && beta1_ < 1.0) ||
        !(beta2_ >= 0.0 && beta2_ < 1.0)) {
      return false;
    }
    const double bc1 = 1 - std::pow(beta1_, t), bc2 = 1 - std::pow(beta2_, t);
    if (bc1 == 0) return false;
    if (kind_ == 2) {  // ATen's fused: -(lr / bc1), std::sqrt(bc2)
      *a = -(lr / bc1);
      *b = std::sqrt(bc2);
    } else {  // for-loop: -(lr / bc1); foreach: (lr / bc1) * -1; both bc2 ** 0.5
      *a = kind_ == 0 ? -(lr / bc1) : (lr / bc1) * -1;
      *b = std::pow(bc2, 0.5);
    }
    for (double x : {*a, *b}) {
      if (x != x || (std::isfinite(x) && std::fabs(x) > FLT_MAX)) return false;
    }
    return true;
  }

  static void bump(py::list tensors) {
    for (py::handle t : tensors) THPVariable_Unpack(t.ptr()).unsafeGetTensorImpl()->bump_version();
  }

  py::dict group_;
  std::vector<py::object> keys_, values_;
  int kind_ = 0, lr_class_ = 0, decay_class_ = 0, flags_ = 0, threads_ = 0, team_size_ = 0;
  bool amsgrad_ = false, clip_ = false, error_if_nonfinite_ = false;
  double max_norm_ = 0, beta1_ = 0, beta2_ = 0, weight_decay_ = 0;
  std::vector<double> scalars_;
  void* sqrt_fn_ = nullptr;
  long long sqrt_mode_ = 0;
  std::vector<int> team_modes_;
  std::vector<int64_t> numels_;
  at::Tensor pieces_;
  norms_team_fn norms_team_ = nullptr;
  clip_scalars_fn clip_scalars_ = nullptr;
  team_fn team_ = nullptr;
  adamw_fn adamw_ = nullptr;
  int known_[10];  // per coefficient class (`scalar_class`) and kNoClip: -1 unknown, 0, 1
};

// Names the two types `plain_cpu` reads (kept referenced for the module's life).
// `hash`: Tensor.__hash__ where the caller checked it returns id(self) for both types, else
// None (then `read_group` looks state entries up through Python's hash).
void set_types(py::object tensor, py::object parameter, py::object hash) {
  tensor_type = reinterpret_cast<PyTypeObject*>(tensor.release().ptr());
  parameter_type = reinterpret_cast<PyTypeObject*>(parameter.release().ptr());
  tensor_hash = hash.is_none() ? nullptr : hash.release().ptr();
}

PYBIND11_MODULE(COTANGENT_MODULE, m) {
  m.def("read_lists", &read_lists, "Check a single-pass call's tensor lists; read addresses");
  m.def("read_group", &read_group, "Read and check one param group's AdamW lists");
  py::class_<GradientSet>(m, "GradientSet")
      .def(py::init<py::list>())
      .def("__len__", &GradientSet::size)
      .def("same", &GradientSet::same)
      .def("holds", &GradientSet::holds)
      .def("covers", &GradientSet::covers);
  py::class_<Replay>(m, "Replay")
      .def(py::init<py::dict, py::tuple, py::dict>())
      .def("run", &Replay::run);
  m.def("clear_grads", &clear_grads, "zero_grad(set_to_none=True) over plain leaf parameters");
  m.def("set_types", &set_types, "The tensor types read_lists reads");
}
