// One token of the KDA recurrence (decode) for XLA:CPU through the typed FFI.
//
// Per stream b and head h, with the state S [dk, dv] (row i: key dimension i; zeros where live[b] == 0):
//   S1 = diag(exp(g)) S;   delta = beta * (v - k^T S1);   S2 = S1 + k delta^T;   o = (scale q)^T S2
// as kernels/kda/xla_cpu.py `recurrent_kda` writes it for T = 1. Each (b, h) takes two passes over its rows
// (the decay with k^T S1 accumulated; the update with q^T S2 accumulated) while they are in L1, and the new
// state is written over the old one (the output aliases the state operand). All f32, rows in ascending i: a
// stream's result does not depend on the other streams.
//
// Built by kernels/kda/cpu_ffi.py on first use (c++ -O3 -march=native -std=c++17 -shared -fPIC).

#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Step(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g,
                ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::S32> live, ffi::Buffer<ffi::F32> state,
                ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> out_state, float scale) {
  const auto sd = state.dimensions();
  if (sd.size() != 4) return ffi::Error::InvalidArgument("glm53_kda_step: state must be [B, H, dk, dv]");
  const int64_t B = sd[0], H = sd[1], dk = sd[2], dv = sd[3];
  if (q.element_count() != B * H * dk || k.element_count() != B * H * dk || g.element_count() != B * H * dk ||
      v.element_count() != B * H * dv || beta.element_count() != B * H || live.element_count() != B ||
      o->element_count() != B * H * dv || out_state->element_count() != B * H * dk * dv)
    return ffi::Error::InvalidArgument(
        "glm53_kda_step: q, k, g [B, H, dk], v [B, H, dv], beta [B, H], live [B] expected");
  std::vector<float> ks(dv), qs(dv), delta(dv);
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const float* qp = q.typed_data() + bh * dk;
    const float* kp = k.typed_data() + bh * dk;
    const float* gp = g.typed_data() + bh * dk;
    const float* vp = v.typed_data() + bh * dv;
    const float bt = beta.typed_data()[bh];
    const bool on = live.typed_data()[bh / H] != 0;
    const float* s = state.typed_data() + bh * dk * dv;
    float* s2 = out_state->typed_data() + bh * dk * dv;  // may be s itself: each row is read before it is written
    for (int64_t j = 0; j < dv; ++j) ks[j] = 0.0f, qs[j] = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {  // S1 = decay * S, k^T S1
      const float decay = std::exp(gp[i]), ki = kp[i];
      const float* row = s + i * dv;
      float* out = s2 + i * dv;
      if (on) {
        for (int64_t j = 0; j < dv; ++j) {
          out[j] = row[j] * decay;
          ks[j] += ki * out[j];
        }
      } else {
        for (int64_t j = 0; j < dv; ++j) out[j] = 0.0f;
      }
    }
    for (int64_t j = 0; j < dv; ++j) delta[j] = bt * (vp[j] - ks[j]);
    for (int64_t i = 0; i < dk; ++i) {  // S2 = S1 + k delta^T, (scale q)^T S2
      const float ki = kp[i], qi = qp[i] * scale;
      float* out = s2 + i * dv;
      for (int64_t j = 0; j < dv; ++j) {
        out[j] += ki * delta[j];
        qs[j] += qi * out[j];
      }
    }
    float* op = o->typed_data() + bh * dv;
    for (int64_t j = 0; j < dv; ++j) op[j] = qs[j];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm53KdaStep, Step,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, H, dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [B, H, dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v [B, H, dv]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g [B, H, dk] (log decay, <= 0)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta [B, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live [B] (0: the state is zeros)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // state [B, H, dk, dv]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o [B, H, dv]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new state [B, H, dk, dv] (aliases state)
                                  .Attr<float>("scale"));
