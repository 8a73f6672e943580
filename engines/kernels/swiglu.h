// silu(gate) * x, the gated MLP's activation, on the CPU with a vectorised exp.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace tandem_kernels {

namespace mx = mlx::core;

// gate / (1 + exp(-gate)) * x, elementwise; both float32 and of one shape. Raises
// std::invalid_argument otherwise.
mx::array swiglu(const mx::array& gate, const mx::array& x);

class SwiGLU : public mx::Primitive {
 public:
  explicit SwiGLU(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "TandemSwiGLU";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

}  // namespace tandem_kernels
