"""One pass over memory for the for-loop, foreach and fused AdamW of `torch.optim.AdamW` (CPU;
float32 parameters, and bfloat16 for for-loop and foreach), and the clip's per-tensor norms in
one call.

Native for-loop (`torch.optim.adam._single_tensor_adam`) and foreach (`_multi_tensor_adam`) AdamW
run about ten elementwise ATen operations per parameter, each a pass over memory. This module
runs the same IEEE float operations, in the same order, element by element, in one pass over the
parameters, gradients and moments (a C++ kernel compiled on first use with the system C++
compiler, loaded through ctypes; no Python loop over elements). What it has to reproduce,
measured on torch 2.13.0+cpu (x86-64; the AVX2 builds of these ATen kernels run on AVX2 and
AVX512 machines alike):

* `exp_avg.lerp_(grad, w)` rounds once: ``fma(w, grad - exp_avg, exp_avg)`` when ``|w| < 0.5``,
  else ``fma(w - 1, grad - exp_avg, grad)`` in ATen's vector body and
  ``-((grad - exp_avg) * (1 - w)) + grad`` in its scalar tail, which differ in the sign of zeros
  at ``w == 1`` (beta1 = 0) (`ATen/native/Lerp.h`, `LerpKernel.cpp`, contracted by the compiler);
* `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)` is
  ``fma(value * grad, grad, exp_avg_sq * beta2)`` (`PointwiseOpsKernel.cpp`, contracted);
* `param.addcdiv_(exp_avg, denom, value=-step_size)` is ``(value * exp_avg) / denom + param``;
* Python-float scalars are rounded to float32 once (`c10::Scalar::to<float>()`) and divisions by
  them are true divisions;
* `exp_avg_sq.sqrt()` is MKL's `vmsSqrt` (`ATen/cpu/vml.h`, mode ``VML_HA | VML_FTZDAZ_OFF |
  VML_ERRMODE_IGNORE``) where torch is built with MKL; it is *not* correctly rounded (about 20% of
  uniformly random inputs come out 1 ULP away from a hardware square root) and returns
  ``+NaN`` (0x7FC00000) for negative inputs. On AMD Zen 5 its outputs, observed for every input
  (black-box), are those of the CPU's 12-bit reciprocal square root estimate, one Goldschmidt
  step and a residual correction with every operation rounded on its own (correctly rounded
  for subnormals and the top 4096 finite values): the kernel computes that itself, 3x faster
  than the call (0.10 against 0.34 ns per element, one thread, L2-resident), where
  `emulation_matches` proved it against `torch.sqrt` on this machine (all 2**31 non-negative
  inputs and 25.3M negative ones, about 2 s once, cached); elsewhere it calls that same function
  on each block (`sqrt_kind`);
* where two operands of one ATen operation are NaN, the NaN kept is the gradient's (lerp,
  addcmul), then ``value * exp_avg`` over the denominator over the parameter (addcdiv);
* `torch.maximum` (amsgrad) differs between ATen's vector body and scalar tail: any NaN gives
  0xFFFFFFFF in the body and 0x7FC00000 in the tail, and for ``+0.0`` against ``-0.0`` the body
  keeps the second operand and the tail the first. So the kernel is told where native's tails
  are: the last ``numel % 16`` elements of each thread chunk of each tensor (`native_pieces`).

bfloat16 parameters (gradients and moments then bfloat16 too) run the same float formulas with
every op's result rounded to bfloat16 as ATen's op does (round to nearest even; a NaN becomes
0xFFFF in the op's vector body, whose unit is 32 elements, and 0x7FC0 in its scalar tail, but
0xFFFF everywhere for `torch.sqrt`, a hardware float square root here, not MKL's); `add_` rounds
its scalar (eps) to bfloat16 first, and so does `_foreach_mul_` (the decay, beta2) where `mul_`
keeps them float (measured on torch 2.13.0, ATen's `BinaryOpsKernel.cpp`, `LerpKernel.cpp`,
`PointwiseOpsKernel.cpp`). amsgrad and the clip multiply stay native for bfloat16.

Fused AdamW (``implementation="fused"``, float32) follows `torch._fused_adamw_` instead
(`FusedAdamKernel.cpp`'s `adam_math`, ADAMW mode; measured on torch 2.13.0+cpu, x86-64): its
AVX2 build runs on AVX2 and AVX512 machines (a vector body of 8 lanes, `fused_vector_unit`, and a
scalar tail of the last ``numel % 8`` elements of each tensor: its thread chunks are whole cache
lines); double scalars rounded to float once; the hardware square root; ``fma(w, d, exp_avg)``
(or ``fma(w - 1, d, grad)`` / ``fma(-d, 1 - w, grad)``) for the lerp; ``fma((1 - beta2) * g, g,
exp_avg_sq * beta2)`` in the body and ``fma(exp_avg_sq, beta2, (1 - beta2) * g * g)`` in the
tail; ``param * decay + (-step_size * exp_avg) / denom``. Its NaN rules differ between body and
tail and between the two compiled copies `at::parallel_for` runs (inline for a tensor of one
cache line or on one thread, else in its parallel region: `fused_pieces`); the kernel source
names each. `tensor_norms` gives ATen's per-tensor CPU 2-norms of contiguous float32 tensors
(`aten_norm2` in the source), where `norms_proven` found them equal to native's.

Nothing here is trusted blindly: `matches_native` runs native AdamW and this pass on probe data
(lengths around the vector unit and the thread-split grain, NaNs of both signs and several
payloads, infinities, signed zeros, subnormals, in parameters, gradients and moments) and
compares every byte; a caller uses the pass only where that probe passed.

`cotangent.AdamW` uses it for its for-loop, foreach and fused calls over CPU tensor lists
(decoupled weight decay, float betas, not capturable / differentiable): one `launch` per (param
group, device, dtype) over the parameters with a gradient at that step, reading and writing
every tensor where it is (`prepare_lists`); the harness's `PackedAdamW` for its for-loop and
foreach calls over flat buffers (`single_pass_adamw_`). `decide` gates every call at every step:
``COTANGENT_SINGLE_PASS=0`` switches it off; without the kernel (`unavailable_reason`: not
x86-64, an ATen CPU capability other than AVX2/AVX512, no C++ compiler, a failed build) native's
op sequence runs and one `SinglePassWarning` per process says so; otherwise a `matches_native`
probe with the group's own hyperparameters must have passed for the verdict key (`key_parts`,
cached in memory and in the calibration file like every other probe). `AdamW.update_path()`
names the path each step took.

Modules: `kernel` (the compiled library, its build, the square root, the OpenMP team's float
modes), `work` (native's division of elements among threads, vector bodies and tails), `lists`
(`prepare_lists`), `passes` (running the pass, and the norms), `probes` (probe data and the
byte comparisons against native), `verdicts` (`decide`, `norms_proven`, the verdict cache).
The names below are re-exported here; module state (`kernel._LIB`, `verdicts._VERDICTS`, ...)
lives in its module.
"""

from __future__ import annotations

from cotangent.singlepass import kernel, lists, passes, probes, verdicts, work
from cotangent.singlepass.kernel import (
    AVX512_FLAGS, Build, COMPILE_FLAGS, DTYPES, EMULATION_CHUNK, EMULATION_KIND,
    EMULATION_PATTERNS, FLT_MAX, FLT_MIN, FORKED_REASON, GRAIN_SIZE, IMPLEMENTATIONS, KINDS,
    MKL_SQRT_MODE, MXCSR_DAZ, SinglePassUnavailable, build, compile_flags, emulated_sqrt_address,
    emulated14_sqrt_address,
    emulation_matches, flushing_now, mkl_sqrt_address, mxcsr, sqrt_address, sqrt_kind, team,
)
from cotangent.singlepass.work import (
    FUSED_TASK_UNIT, aten_vector_unit, fused_pieces, fused_vector_unit, native_pieces,
    thread_chunks,
)
from cotangent.singlepass.lists import (
    Prepared, prepare_lists, read_group, spans_disjoint,
)
from cotangent.singlepass.passes import (
    clip_scalars, gradient_norms, gradient_norms_team, launch, native_step_scalars, norms_at, single_pass_adamw_,
    single_pass_adamw_lists_, tensor_norms,
)
from cotangent.singlepass.probes import (
    GRID_EXP_AVG, GRID_EXP_AVG_CLEAN, GRID_EXP_AVG_SQ, GRID_EXP_AVG_SQ_CLEAN, GRID_GRAD,
    GRID_GRAD_CLEAN, GRID_MAX, GRID_MAX_CLEAN, GRID_PARAM, GRID_PARAM_CLEAN, PROBE_LENGTHS,
    matches_native, norm_probe_tensors, norms_match_native, probe_data, special_grid,
)
from cotangent.singlepass.verdicts import (
    AMSGRAD_DAZ, ENV_SWITCH, ISAS, NORM_PROBE_KIND, PROBE_KIND, SinglePassWarning, Step, decide,
    forget_verdicts, key_parts, lerp_branch, norms_proven, off_reason, process_report, proven,
    scalar_class,
    static_refusal, switched_on, unavailable_reason,
)

__all__ = ["kernel", "lists", "passes", "probes", "verdicts", "work",
           "AVX512_FLAGS", "Build", "COMPILE_FLAGS", "DTYPES", "EMULATION_CHUNK", "EMULATION_KIND",
           "EMULATION_PATTERNS", "FLT_MAX", "FLT_MIN", "FORKED_REASON", "GRAIN_SIZE",
           "IMPLEMENTATIONS", "KINDS", "MKL_SQRT_MODE", "MXCSR_DAZ", "SinglePassUnavailable",
           "build", "compile_flags", "emulated_sqrt_address", "emulated14_sqrt_address",
           "emulation_matches", "flushing_now",
           "mkl_sqrt_address", "mxcsr", "sqrt_address", "sqrt_kind", "team", "FUSED_TASK_UNIT",
           "aten_vector_unit", "fused_pieces", "fused_vector_unit", "native_pieces",
           "thread_chunks", "Prepared", "prepare_lists", "read_group", "spans_disjoint",
           "clip_scalars", "gradient_norms", "gradient_norms_team", "launch", "native_step_scalars", "norms_at",
           "single_pass_adamw_", "single_pass_adamw_lists_", "tensor_norms", "GRID_EXP_AVG", "GRID_EXP_AVG_CLEAN",
           "GRID_EXP_AVG_SQ", "GRID_EXP_AVG_SQ_CLEAN", "GRID_GRAD", "GRID_GRAD_CLEAN", "GRID_MAX",
           "GRID_MAX_CLEAN", "GRID_PARAM", "GRID_PARAM_CLEAN", "PROBE_LENGTHS", "matches_native",
           "norm_probe_tensors", "norms_match_native", "probe_data", "special_grid", "AMSGRAD_DAZ",
           "ENV_SWITCH", "ISAS", "NORM_PROBE_KIND", "PROBE_KIND", "SinglePassWarning", "Step",
           "decide", "forget_verdicts", "key_parts", "lerp_branch", "norms_proven",
           "process_report", "off_reason", "proven", "scalar_class", "static_refusal",
           "switched_on", "unavailable_reason"]
