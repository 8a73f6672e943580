// x @ dequantize(w).T for mlx's affine quantization, on the CPU, with the weights left packed.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace tandem_kernels {

namespace mx = mlx::core;

// y (..., N) = x (..., K) @ (scales * codes + biases).T, codes packed as mlx.core.quantize
// packs them (w: uint32 (N, K * bits / 32); scales, biases: (N, K / group_size)). x float32;
// scales and biases float32, float16 or bfloat16. Raises std::invalid_argument otherwise.
mx::array affine_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits);

// Whether a decode's product runs in integers (AVX-512 VBMI + VNNI: x rounded to int16 per
// group) rather than in floats; fixed when the module is built.
bool integer_dot();

// Rows of x from which the product is handed to the BLAS on dequantized weight tiles.
int gemm_rows();
void set_gemm_rows(int rows);

class AffineMatmul : public mx::Primitive {
 public:
  AffineMatmul(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "TandemAffineMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
};

}  // namespace tandem_kernels
