// Cotangent's tensor-list reader: checks a single-pass call's tensor lists and reads their
// addresses in one C++ loop, through the Python objects (no reference counting, no Python
// attribute lookups). Built and loaded by cotangent/tensorlists.py; the rules it checks are
// those of `singlepass.prepare_lists`'s contiguous case, which is the reference (that Python
// code runs wherever this returns 0, and says why a list is refused).
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
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

// Names the two types `plain_cpu` reads (kept referenced for the module's life).
void set_types(py::object tensor, py::object parameter) {
  tensor_type = reinterpret_cast<PyTypeObject*>(tensor.release().ptr());
  parameter_type = reinterpret_cast<PyTypeObject*>(parameter.release().ptr());
}

PYBIND11_MODULE(COTANGENT_MODULE, m) {
  m.def("read_lists", &read_lists, "Check a single-pass call's tensor lists; read addresses");
  m.def("set_types", &set_types, "The tensor types read_lists reads");
}
