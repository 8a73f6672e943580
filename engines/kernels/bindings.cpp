// The Python module of tandem's CPU kernels (engines/kernels/__init__.py loads it).
#include <nanobind/nanobind.h>

#include "affine_matmul.h"
#include "swiglu.h"
#include "thread_pool.h"

namespace nb = nanobind;

NB_MODULE(_tandem_kernels, m) {
  m.doc() = "tandem's CPU kernels for mlx";
  m.def("affine_matmul", &tandem_kernels::affine_matmul, nb::arg("x"), nb::arg("w"),
        nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        "x @ dequantize(w, scales, biases, group_size, bits).T with the codes left packed");
  m.def("swiglu", &tandem_kernels::swiglu, nb::arg("gate"), nb::arg("x"),
        "silu(gate) * x for float32 arrays of one shape, with a vectorised exp");
  m.def("threads", [] { return tandem_kernels::ThreadPool::instance().threads(); });
  m.def("set_threads", [](int threads) {
    tandem_kernels::ThreadPool::instance().resize(threads < 1 ? 1 : threads);
  });
  m.def("integer_dot", &tandem_kernels::integer_dot);
  m.def("gemm_rows", &tandem_kernels::gemm_rows);
  m.def("set_gemm_rows", &tandem_kernels::set_gemm_rows);
}
