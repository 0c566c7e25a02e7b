"""The CUDA compatibility layer without a GPU: source translation and nvcc compile checks."""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import nvcc_check
import pytest
from msl_features import FEATURES, Feature

import mlx_metaltile as mt
from mlx_metaltile import backends, cuda
from mlx_metaltile._templates import read_text
from mlx_metaltile.cuda import _helpers
from mlx_metaltile.cuda import _translate as tr
from mlx_metaltile.emulator import _cache

BODY = """
threadgroup float tile[8][33];
threadgroup uint counter;
const uint r = threadgroup_position_in_grid.y;
threadgroup float* p = &tile[0][0];
out[r] = x[r] * scale + 0.5h;
"""


def _translate(body=BODY, scalar=(False, True), guarded=False, atomic=False):
    return tr.translate_body(tr.prepass_body(body), ["x", "scale"], ["out"],
                             scalar_inputs=scalar, guarded=guarded, atomic_outputs=atomic)


# ---- translation ---------------------------------------------------------------------------

def test_builtins_are_declared_only_when_used():
    src = _translate().source
    assert "const uint3 threadgroup_position_in_grid = uint3(blockIdx.x, blockIdx.y, blockIdx.z);" in src
    for name in tr.BUILTIN_NAMES:
        if name != "threadgroup_position_in_grid":
            assert f" {name} =" not in src, name


def test_builtins_map_to_cuda_indices():
    body = "\n".join(f"use({name});" for name in tr.BUILTIN_NAMES)
    src = tr.translate_body(body, [], ["out"], scalar_inputs=[]).source
    decl = dict(re.findall(r"const \w+ (\w+) = (.+);", src))
    assert set(decl) == set(tr.BUILTIN_NAMES)
    assert decl["thread_position_in_grid"] == (
        "uint3((blockIdx.x * blockDim.x + threadIdx.x), (blockIdx.y * blockDim.y + threadIdx.y), "
        "(blockIdx.z * blockDim.z + threadIdx.z))")
    assert decl["threads_per_threadgroup"] == "uint3(blockDim.x, blockDim.y, blockDim.z)"
    assert decl["threads_per_grid"] == (
        "uint3(gridDim.x * blockDim.x, gridDim.y * blockDim.y, gridDim.z * blockDim.z)")
    assert decl["thread_index_in_simdgroup"].endswith("% 32u)")
    assert decl["threads_per_simdgroup"] == "32u"


def test_guarded_grid_comes_in_as_an_input_and_trims_edge_threadgroups():
    body = "use(threads_per_threadgroup); use(threads_per_grid);"
    wrapped = tr.translate_body(body, ["x"], ["out"], scalar_inputs=[False], guarded=True)
    assert wrapped.input_names == ("x", tr.GRID_INPUT)
    lines = wrapped.source.splitlines()
    guard = next(i for i, ln in enumerate(lines) if ln.startswith("if ("))
    assert "blockIdx.x * blockDim.x + threadIdx.x >= mt_grid[0]" in lines[guard]
    assert lines[guard].rstrip().endswith("return;  // past Metal's grid")
    assert "min(blockDim.x, mt_grid[0] - blockIdx.x * blockDim.x)" in wrapped.source
    assert "uint3(mt_grid[0], mt_grid[1], mt_grid[2])" in wrapped.source
    assert guard < next(i for i, ln in enumerate(lines) if "kernel body" in ln)


def test_threadgroup_arrays_become_shared_and_pointers_lose_address_spaces():
    src = _translate().source
    assert "MT_THREADGROUP_ARRAY(tile, [8][33], float);" in src
    assert "MT_THREADGROUP_ARRAY(counter, , uint);" in src
    assert "float* p = &tile[0][0];" in src
    assert not re.search(r"\bthreadgroup\b", src)
    assert "__shared__ __align__(16) __VA_ARGS__ name dims" in cuda.compat_header()


def test_scalar_inputs_are_references_to_the_first_element():
    wrapped = _translate()
    assert wrapped.input_names == ("x", "mt_scalar_scale")
    assert "const auto& scale = *mt_scalar_scale;" in wrapped.source
    assert _translate(scalar=(False, False)).input_names == ("x", "scale")


def test_packed_scalars_come_from_one_uint32_input_in_order():
    body = tr.prepass_body("out[0] = x[0] * scale + float(n) + float(m);")
    wrapped = tr.translate_body(body, ["n", "x", "scale", "k", "m"], ["out"],
                                scalar_inputs=[True, False, True, True, True],
                                packed_types=["uint", None, "float", None, "int"])
    assert wrapped.input_names == ("x", "mt_scalar_k", tr.PACKED_INPUT)
    assert "const uint n = mt_unpack_scalar<uint>(mt_scalars[0]);" in wrapped.source
    assert "const float scale = mt_unpack_scalar<float>(mt_scalars[1]);" in wrapped.source
    assert "const int m = mt_unpack_scalar<int>(mt_scalars[2]);" in wrapped.source
    assert "const auto& k = *mt_scalar_k;" in wrapped.source
    with pytest.raises(ValueError, match="only scalar"):
        tr.translate_body(body, ["x"], ["out"], scalar_inputs=[False], packed_types=["uint"])


def test_kernel_packs_the_scalars_the_host_knows(monkeypatch):
    """Scalars made by _msl.constants.scalar travel packed (their exact bits, at least 16
    bytes: MLX keeps smaller arrays in a slow pool on CUDA); any other 0-d array as it is."""
    from mlx_metaltile._msl import constants

    k = cuda.metal_kernel("k", ["x", "n", "scale", "kv", "neg"], ["out"], "out[0] = x[0];")
    seen = {}

    def variant(kinds, guarded):
        seen["kinds"] = kinds
        return None, lambda *, inputs, **_: seen.setdefault("inputs", inputs)

    monkeypatch.setattr(k, "_variant", variant)
    x, kv = mx.zeros((4,)), mx.array(7, dtype=mx.uint32)  # kv: not made by scalar()
    n, scale = constants.scalar(5, mx.uint32), constants.scalar(-0.0, mx.float32)
    assert constants.scalar(0.0, mx.float32) is not scale  # -0.0 keyed by its bits
    neg = constants.scalar(-3, mx.int32)
    k(inputs=[x, n, scale, kv, neg], output_shapes=[(1,)], output_dtypes=[mx.float32],
      grid=(32, 1, 1), threadgroup=(32, 1, 1))
    assert seen["kinds"] == ("a", "uint", "float", "s", "int")
    x_in, kv_in, packed = seen["inputs"]
    assert x_in is x and kv_in is kv
    assert packed.dtype == mx.uint32 and packed.size >= 4
    assert packed.tolist()[:3] == [5, 0x80000000, 2**32 - 3]


def test_scalar_constants_keep_their_bits_while_held(monkeypatch):
    """A scalar the value cache has forgotten but something still holds (an op's remembered
    plan) keeps its bits; values NumPy would not convert exactly get none (they travel as
    0-d arrays); an array made elsewhere has none."""
    import gc

    from mlx_metaltile._msl import constants

    monkeypatch.setattr(constants, "_LIMIT", 2)
    held = [constants.scalar(v, mx.uint32) for v in (101, 102, 103)]
    assert 101 not in [k[1] for k in constants._made]  # forgotten by the cache
    assert [constants.known_bits(a) for a in held] == [101, 102, 103]
    assert constants.known_bits(constants.scalar(1e40, mx.float32)) is None
    assert constants.known_bits(constants.scalar(-1, mx.uint32)) is None
    assert constants.known_bits(mx.array(101, dtype=mx.uint32)) is None
    at = id(held[0])
    del held
    gc.collect()
    assert at not in constants._bits


def test_atomic_outputs_are_views_of_the_output_buffers():
    wrapped = _translate(atomic=True)
    assert wrapped.output_names == ("mt_atomic_out",)
    assert "auto* const out = mt_as_atomic(mt_atomic_out);" in wrapped.source


def test_msl_spellings_without_cuda_equivalent_are_rewritten():
    src = _translate().source
    assert "MT_HALF_LITERAL(0.5f)" in src and "0.5h" not in src
    header = tr.translate_header(
        "#include <metal_stdlib>\n#pragma once\nconstant float k[2] = {1, 2};\n"
        "inline float f(const device float* p, thread float& acc) {\n"
        "#pragma clang loop unroll(full)\n  for (int i = 0; i < 2; ++i) acc += p[i];\n"
        "  return acc;\n}\n")
    helpers = header[header.index("namespace mlx::core::cu {"):]
    assert "<metal_stdlib>" not in helpers and "#pragma once" not in helpers
    assert "__constant__ float k[2]" in helpers
    assert "inline float f(const float* p, float& acc)" in helpers
    assert "#pragma unroll\n" in helpers
    assert helpers.index("#define inline __device__ inline") < helpers.index("inline float f")
    assert "#undef inline" in helpers


def test_half_and_bfloat_literals_become_the_shared_macros():
    body = tr.prepass_body("out[0] = 2bf + 1.5h + 3h + 1e-3H + .5BF + x1h + 0x1h;")
    assert body == ("out[0] = MT_BFLOAT_LITERAL(2) + MT_HALF_LITERAL(1.5f) + MT_HALF_LITERAL(3)"
                    " + MT_HALF_LITERAL(1e-3f) + MT_BFLOAT_LITERAL(.5f) + x1h + 0x1h;")


def test_compat_header_is_included_by_path_with_its_digest():
    """Small kernel sources (MLX hashes them per launch); the digest tracks header edits."""
    include = tr.compat_include()
    paths = re.findall(r'#include "(.+)"', include)
    # the parts of msl_compat.cuh, each by its absolute path, make up the whole header
    assert len(paths) >= 6 and all(Path(p).is_absolute() for p in paths)
    assert all(Path(p).read_text(encoding="utf-8") in cuda.compat_header() for p in paths)
    digest = hashlib.sha256(cuda.compat_header().encode()).hexdigest()[:16]
    assert f"sha256:{digest}" in include
    assert tr.translate_header("").startswith(include)
    assert len(tr.translate_header("")) < 1000


def _cuda_kernel(spec_name: str) -> cuda.CudaKernel:
    spec = next(s for s in mt.kernels() if s.name == spec_name)
    header, body = backends.kernel_text(spec, "cuda")
    return cuda.metal_kernel(spec.name, list(spec.input_names), list(spec.output_names),
                             body, header)


@pytest.fixture
def helpers_cache(tmp_path, monkeypatch):
    """A private cache folder, and the helpers' in-process memo and warning as new."""
    monkeypatch.setenv("MLX_METALTILE_CACHE", str(tmp_path))
    monkeypatch.setattr(_helpers, "_included", {})
    monkeypatch.setattr(_helpers, "_filed_texts", {})
    monkeypatch.setattr(_helpers, "_warned", False)
    monkeypatch.setattr(_cache, "_roots", {})
    return tmp_path / "cuda"


def test_kernel_helpers_come_from_a_checked_cache_file(helpers_cache):
    """MLX hashes the whole source per launch: a kernel's header is two includes, and the
    file holds exactly the helpers the written-out header carries."""
    kernel = _cuda_kernel("expert_glu_simd_rows")
    helpers = tr.translate_helpers(kernel.header)
    assert len(helpers) > 4000 and helpers not in kernel.cuda_header
    assert kernel.cuda_header.startswith(tr.compat_include())
    (path,) = re.findall(r'#include "(.+)"', kernel.cuda_header[len(tr.compat_include()):])
    path = Path(path)
    assert path.is_absolute() and path.is_relative_to(helpers_cache)
    assert path.read_text(encoding="utf-8") == helpers
    assert tr.compat_include() + helpers == tr.translate_header(kernel.header)
    assert path.stat().st_mode & 0o022 == 0 and path.parent.stat().st_mode & 0o077 == 0
    assert len(kernel.cuda_header) < 1000
    # the same helpers (another kernel of the template) share the file
    assert _cuda_kernel("expert_glu_shared_rows").cuda_header == kernel.cuda_header


# The source MLX hashes per launch, at most (header and body; MLX adds its signature lines):
# 11.4 KB for the largest kernel (sdpa_multi's split kernel) when this was written.
MAX_SOURCE = 12_000


def test_every_kernel_sends_a_short_source(helpers_cache):
    """MLX hashes a kernel's whole source on every launch (about 3.5 us per 20 KB on an
    H200): no kernel's may grow back to the 7 to 24 KB it was with the helpers and the
    comments inline."""
    sizes = {}
    for spec in mt.kernels():
        if "cuda" not in spec.backends:
            continue
        kernel = _cuda_kernel(spec.name)
        body = kernel.translate([False] * len(spec.input_names)).source
        sizes[spec.name] = len(tr.MLX_DEFAULT_HEADER + kernel.cuda_header + body)
        assert "//" not in body.split("// ---- kernel body ----\n", 1)[1], spec.name
    assert len(sizes) >= 25
    assert max(sizes.values()) <= MAX_SOURCE, sizes


def test_a_changed_helpers_file_is_rebuilt_never_used(helpers_cache, monkeypatch):
    kernel = _cuda_kernel("sdpa_multi_split")
    (path,) = re.findall(r'#include "(.+/helpers.cuh)"', kernel.cuda_header)
    Path(path).write_text("#error planted\n", encoding="utf-8")
    monkeypatch.setattr(_helpers, "_included", {})  # as a new process finds it
    with pytest.warns(RuntimeWarning, match="rebuilding the cache entry"):
        again = _cuda_kernel("sdpa_multi_split")
    assert again.cuda_header == kernel.cuda_header
    assert Path(path).read_text(encoding="utf-8") == tr.translate_helpers(kernel.header)


def test_a_helpers_file_removed_while_running_is_written_back(helpers_cache):
    """A cache cleared under a running process: the next prepared launch puts the same
    checked file back where the kernel's source names it, before MLX compiles it."""
    kernel = _cuda_kernel("gated_rms_norm_row")
    (path,) = re.findall(r'#include "(.+/helpers.cuh)"', kernel.cuda_header)
    shutil.rmtree(helpers_cache.parent)
    kernel.prepare_launch([None], [(4,)], [mx.float32], (32, 1, 1), (32, 1, 1), [])
    assert Path(path).read_text(encoding="utf-8") == tr.translate_helpers(kernel.header)
    assert Path(path).parent.parent.stat().st_mode & 0o077 == 0


def test_an_unusable_cache_leaves_the_helpers_in_the_source(helpers_cache):
    helpers_cache.mkdir(parents=True)
    helpers_cache.chmod(0o777)  # others could plant helpers: refused
    with pytest.warns(RuntimeWarning, match=r"\[cuda\] kernel helpers stay .* writable by "
                                            "group or others"):
        kernel = _cuda_kernel("gated_rms_norm_row")
    assert kernel.cuda_header == tr.translate_header(kernel.header)
    assert not any(helpers_cache.iterdir())


def test_short_helpers_stay_in_the_source(helpers_cache):
    kernel = cuda.metal_kernel("k", ["x"], ["out"], "out[0] = x[0];",
                               "inline float twice(float v) { return 2 * v; }\n")
    assert kernel.cuda_header == tr.translate_header(kernel.header)
    assert not helpers_cache.exists()


def test_translation_unit_matches_mlx_layout():
    wrapped = tr.translate_body("out[0] = x_shape[0] + x_strides[0] + x_ndim + s;",
                                ["x", "s"], ["out"], scalar_inputs=[False, True])
    template = [("T", mx.bfloat16), ("N", 4), ("B", False)]
    name = tr.mlx_kernel_name("k", template)
    assert name == "custom_kernel_k_bfloat16_t_4_f"
    text = tr.kernel_definition(name, wrapped.source, [("x", mx.float16, 2),
                                ("mt_scalar_s", mx.int32, 0)], [("out", mx.float32)], template)
    expected_head = (
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_k_bfloat16_t_4_f(\n"
        "    const __half* x,\n"
        "    const __grid_constant__ Shape x_shape,\n"
        "    const __grid_constant__ Strides x_strides,\n"
        "    const __grid_constant__ int x_ndim,\n"
        "    const int32_t* mt_scalar_s,\n"
        "    float* out) {\n"
        "  using T = __nv_bfloat16;\n"
        "  constexpr int N = 4;\n"
        "  constexpr bool B = false;\n\n")
    assert text.startswith(expected_head)
    assert text.endswith("\n}\n\n} // namespace mlx::core::cu\n")
    unit = tr.translation_unit("// header\n", [text])
    assert unit.startswith('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n'
                           "#include <cooperative_groups.h>\n\n// header\nnamespace mlx")


@pytest.mark.parametrize("grid, tg, whole", [
    ((64, 3, 1), (32, 1, 1), True),
    ((16, 1, 1), (32, 1, 1), True),  # MLX shrinks the block to the grid
    ((100, 1, 1), (32, 1, 1), False),
    ((64, 5, 1), (32, 2, 1), False),
    ((1024, 4096, 1), (1024, 1, 1), True),
])
def test_grid_is_whole(grid, tg, whole):
    assert tr.grid_is_whole(grid, tg) is whole


def test_kernel_objects_build_without_a_gpu():
    k = cuda.metal_kernel("k", ["x", "scale"], ["out"], BODY)
    assert k.translate((False, True)).input_names == ("x", "mt_scalar_scale")


def test_backend_availability():
    reason = cuda.unavailable_reason()
    assert reason == backends.unavailable_reason("cuda")
    if reason is not None:
        assert "cuda" in reason.lower()
        with pytest.raises(backends.BackendUnavailableError, match="cuda"):
            with backends.use_backend("cuda"):
                pass
        assert backends.resolve_backend("auto") in ("metal", "reference")
    else:
        assert backends.resolve_backend("auto") in ("metal", "cuda")


# ---- compile checks ------------------------------------------------------------------------

def feature_unit(feature: Feature, guarded: bool = False) -> str:
    kernel = cuda.metal_kernel(f"mt_test_{feature.name}", [n for n, _, _ in feature.inputs],
                               [n for n, _ in feature.outputs], feature.source, feature.header,
                               atomic_outputs=feature.atomic_outputs)
    definitions = []
    for template in feature.templates:
        ins, outs = feature.resolve(template)
        wrapped = kernel.translate([nd == 0 for _, _, nd in ins], guarded=guarded)
        params = [(cn, d, nd) for cn, (_, d, nd) in zip(wrapped.input_names[:len(ins)], ins, strict=True)]
        if guarded:
            params.append((tr.GRID_INPUT, mx.uint32, 1))
        outputs = [(cn, d) for cn, (_, d) in zip(wrapped.output_names, outs, strict=True)]
        name = tr.mlx_kernel_name(kernel.name + ("_g" if guarded else ""), template)
        definitions.append(tr.kernel_definition(name, wrapped.source, params, outputs, template))
    return tr.translation_unit(kernel.cuda_header, definitions)


COMPILERS = (
    pytest.param("nvcc", id="nvcc", marks=pytest.mark.skipif(
        nvcc_check.find_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME)")),
    pytest.param("nvrtc", id="nvrtc", marks=pytest.mark.skipif(
        nvcc_check.load_nvrtc() is None, reason=f"libnvrtc not found (set {nvcc_check.NVRTC_ENV})")),
)


def compile_units(compiler: str, units: dict[str, str]) -> dict:
    if compiler == "nvcc":
        return nvcc_check.compile_units(units)
    return nvcc_check.nvrtc_compile_units(units)


# what the CUDA layer accepts (the others are refused when made: test_msl_conformance.py)
CUDA_FEATURES = tuple(f for f in FEATURES if "cuda" not in f.refused_by)
_compiled: dict[str, dict] = {}


def compiled_features(compiler: str) -> dict:
    if compiler not in _compiled:
        units = {f.name: feature_unit(f) for f in CUDA_FEATURES}
        units["edge_threadgroups_guarded"] = feature_unit(
            next(f for f in CUDA_FEATURES if f.name == "edge_threadgroups"), guarded=True)
        _compiled[compiler] = compile_units(compiler, units)
    return _compiled[compiler]


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("unit", [f.name for f in CUDA_FEATURES] + ["edge_threadgroups_guarded"])
def test_header_feature_compiles(compiler, unit):
    result = compiled_features(compiler)[unit]
    assert result.ok, f"{compiler} failed on {unit}:\n{result.log[-8000:]}"


@pytest.mark.parametrize("compiler", COMPILERS)
def test_negative_control_compile_errors_are_reported(compiler):
    """A body using something the header lacks must fail the check (never a silent pass)."""
    broken = Feature(name="broken", source="out[0] = simd_no_such_function(x[0]);",
                     inputs=(("x", mx.float32, 1),), outputs=(("out", mx.float32),))
    result = compile_units(compiler, {"broken": feature_unit(broken)})["broken"]
    assert not result.ok
    assert "simd_no_such_function" in result.log


class _KernelRecorder:
    """Stands in for ``mx.fast.cuda_kernel``: every kernel object it makes records its
    calls as (kernel name, keyword arguments) and returns zeros."""

    def __init__(self):
        self.calls = []

    def __call__(self, *, name, **_):
        def call(**kwargs):
            self.calls.append((name, kwargs))
            return [mx.zeros(s, dtype=d)
                    for s, d in zip(kwargs["output_shapes"], kwargs["output_dtypes"],
                                    strict=True)]
        return call


@pytest.mark.parametrize("grid", [(32, 1, 1), (100, 1, 1)], ids=("whole", "guarded"))
def test_prepared_launch_makes_the_unprepared_call(monkeypatch, grid):
    """A prepared launch hands MLX what the unprepared call does (the same variant, the
    same inputs), its arrays examined per call: a host-known scalar among them is packed
    with the constants' (its own bits each call), a device 0-d one passed as itself."""
    from mlx_metaltile._msl import constants

    made = _KernelRecorder()
    monkeypatch.setattr(mx.fast, "cuda_kernel", made)
    k = cuda.metal_kernel("k", ["x", "n", "kv", "c", "scale", "y"], ["out"], "out[0] = x[0];")
    n, scale = constants.scalar(5, mx.uint32), constants.scalar(0.5, mx.float32)
    c = mx.array(3, dtype=mx.int32)  # a 0-d constant the host does not know
    x, y = mx.zeros((4,)), mx.ones((2,))
    options = dict(output_shapes=[(1,)], output_dtypes=[mx.float32], grid=grid,
                   threadgroup=(32, 1, 1), template=[("T", mx.float32)])
    run = k.prepare_launch([None, n, None, c, scale, None], **options)
    guard = "_g" if grid == (100, 1, 1) else ""
    half = 0x3F000000  # 0.5's bits
    for kv, suffix, packed in ((constants.scalar(9, mx.uint32), "apupuspfa", [5, 9, half]),
                               (constants.scalar(10, mx.uint32), "apupuspfa", [5, 10, half]),
                               (mx.array(9, dtype=mx.uint32), "apusspfa", [5, half]),
                               (mx.zeros((3,), dtype=mx.uint32), "apuaspfa", [5, half])):
        run([x, kv, y])
        k(inputs=[x, n, kv, c, scale, y], **options)
        (got_name, got), (want_name, want) = made.calls[-2:]
        assert got_name == want_name == f"k_{suffix}{guard}"
        assert got.keys() == want.keys()
        got_inputs, want_inputs = got.pop("inputs"), want.pop("inputs")
        assert got == want
        assert len(got_inputs) == len(want_inputs)
        assert all(a is b for a, b in zip(got_inputs, want_inputs, strict=True))
        passed = [x, c, y] if len(packed) == 3 else [x, kv, c, y]
        assert all(a is b for a, b in zip(got_inputs, passed, strict=False))
        assert got_inputs[len(passed)].tolist()[:len(packed)] == packed
        assert len(got_inputs) == len(passed) + 1 + bool(guard)


def test_launch_bounds_reach_the_kernel_and_cap_its_threadgroup():
    """A spec's cuda_launch_bounds become the __launch_bounds__ of the kernel MLX declares
    after the header; a launch past its thread bound is refused before any GPU work."""
    k = cuda.metal_kernel("k", ["x", "scale"], ["out"], BODY, launch_bounds=(256, 4))
    assert k.cuda_header.endswith(tr.launch_bounds_directive(256, 4))
    assert "__launch_bounds__" not in cuda.metal_kernel("k", ["x"], ["out"], BODY).cuda_header
    x = mx.zeros((4,))
    with pytest.raises(ValueError, match=r"\[cuda\] kernel k: a threadgroup of 512 threads, "
                                         r"above its launch bounds' 256"):
        k.prepare_launch([None], [(4,)], [mx.float32], (512, 1, 1), (512, 1, 1), [])
    with pytest.raises(ValueError, match=r"\[cuda\] kernel k: a threadgroup of 512"):
        k(inputs=[x, x], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(512, 1, 1),
          threadgroup=(512, 1, 1))
    for bad in ((1000, 2), (2048, 1), (1024, 0)):
        with pytest.raises(ValueError, match=r"\[cuda\] launch bounds"):
            tr.launch_bounds_directive(*bad)


@pytest.mark.skipif(nvcc_check.find_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME)")
def test_launch_bounds_are_in_the_compiled_kernel():
    """nvcc's PTX of gated_rms_norm's row kernel carries its spec's bounds (1024 threads, 2
    threadgroups per SM); the simd-rows kernel, which has none, carries neither."""
    import mlx_metaltile.ops.gated_rms_norm  # noqa: F401 (the module, not the op)
    from mlx_metaltile._registry import instantiations
    g = sys.modules["mlx_metaltile.ops.gated_rms_norm"]

    for spec, expected in ((g.REGISTER_SPEC, True), (g.SIMD_ROWS_SPEC, False)):
        assert (spec.cuda_launch_bounds == (1024, 2)) is expected
        ptx = nvcc_check.ptx_text(nvcc_check.spec_unit(spec, list(instantiations(spec))[:1]))
        entries = ptx.count(".entry")
        assert entries >= 1
        assert ptx.count(".maxntid 1024, 1, 1") == (entries if expected else 0)
        assert ptx.count(".minnctapersm 2") == (entries if expected else 0)


def _mma_kernel_ptx(dtype: str, D: int, pf: int) -> dict[str, int]:
    """PTX instruction counts of sdpa_multi's MMA kernel (no mask) as the op launches it."""
    sdpa = sys.modules["mlx_metaltile.ops.sdpa_multi"]
    inst = nvcc_check.spec_instance(sdpa.MMA_SPEC, T=dtype, D=D, PF=pf, MASK_KIND=0)
    return nvcc_check.ptx_counts(nvcc_check.ptx_text(nvcc_check.spec_unit(sdpa.MMA_SPEC,
                                                                          [inst])))[0]


@pytest.mark.skipif(nvcc_check.find_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME)")
@pytest.mark.parametrize("dtype, D, pf", [("float16", 128, 1), ("bfloat16", 128, 1),
                                          ("bfloat16", 256, 0)])
def test_mma_kernel_reads_b_operands_in_the_tensor_core_layout(dtype, D, pf):
    """sdpa_multi's MMA kernel on CUDA (its block loop unrolled: one copy in the PTX): K and V
    as mt_sg_bmatrix read by ldmatrix (no movmatrix), P V's terms 0 and 1 paired: 4 D/8
    m16n8k8 for S and (PT - 1) 4 D/8 for P V."""
    import mlx_metaltile.ops.sdpa_multi  # noqa: F401 (the module, not the op)

    terms = {"float16": 2, "bfloat16": 3}[dtype]
    counts = _mma_kernel_ptx(dtype, D, pf)
    assert counts["movmatrix"] == 0
    assert counts["mma"] == 4 * (D // 8) + (terms - 1) * 4 * (D // 8)
    assert counts["ldmatrix"] >= 2 * (D // 8)  # K's and V's 4-fragment reads


@pytest.mark.skipif(nvcc_check.find_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME)")
def test_mma_kernel_negative_control_plain_fragments():
    """The same counts with V read as a plain simdgroup_matrix and the terms unpaired: one
    movmatrix per P V product and PT products per V fragment (what the test above rules
    out)."""
    import mlx_metaltile.ops.sdpa_multi  # noqa: F401 (the module, not the op)

    sdpa = sys.modules["mlx_metaltile.ops.sdpa_multi"]
    with backends.template_override(
            sdpa.MMA_SPEC, ("mt_sg_bmatrix<T> vf[4];", "simdgroup_matrix<T, 8, 8> vf[4];"),
            ("mt_mma_pair(of[i], pf[0][j], lo, pf[1][j], vf[j]);",
             "simdgroup_multiply_accumulate(of[i], pf[0][j], vf[j], of[i]); "
             "simdgroup_multiply_accumulate(lo, pf[1][j], vf[j], lo);")):
        counts = _mma_kernel_ptx("bfloat16", 128, 1)
    assert counts["movmatrix"] == 3 * 4 * 16
    assert counts["mma"] == 4 * 16 + 3 * 4 * 16


def _qmv_ptx_counts(what: str, spec=None, bits: int = 4) -> list[int]:
    """Per kernel of expert_qmv.metal's bfloat16 affine instance of ``spec`` (default
    expert_qmv's own) at ``bits``: how often its PTX holds `what`."""
    spec = spec or sys.modules["mlx_metaltile.ops.expert_qmv"].SPEC
    inst = nvcc_check.spec_instance(spec, T="bfloat16", BITS=bits, GROUP_SIZE=64, MODE=0)
    ptx = nvcc_check.ptx_text(nvcc_check.spec_unit(spec, [inst]))
    return [body.count(what) for body in ptx.split(".entry ")[1:]]


def _qmv_lop3_counts() -> list[int]:
    return _qmv_ptx_counts("lop3.b32")


@pytest.mark.skipif(nvcc_check.find_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME)")
def test_converged_shuffles_take_the_full_mask():
    """common.h's converged helpers shuffle under the constant full mask on CUDA: expert_qmv,
    whose SIMD-group calls are all converged ones, asks for no active mask; its group shuffle
    as a plain simd_shuffle asks for one per call site."""
    import mlx_metaltile.ops.expert_qmv  # noqa: F401 (the module, not the op)

    shuffles = _qmv_ptx_counts("shfl.sync")
    assert shuffles and all(c > 0 for c in shuffles)
    assert _qmv_ptx_counts("activemask") == [0] * len(shuffles)
    qmv = sys.modules["mlx_metaltile.ops.expert_qmv"]
    with backends.template_override(
            qmv.SPEC, ("constexpr bool PLAIN_SHUFFLES = ROUND && MODE == 0 && BITS == 4;",
                       "constexpr bool PLAIN_SHUFFLES = true;")):
        assert all(c > 0 for c in _qmv_ptx_counts("activemask"))


@pytest.mark.skipif(nvcc_check.find_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME)")
def test_gemv_rows_plain_shuffles_at_four_bits():
    """expert_qmv.metal's PLAIN_SHUFFLES: moe_gather_qmm's GEMV rows (ROUND) at 4 bits take
    the plain simd_shuffle / simd_sum (an active mask per call, measured faster on an H200),
    at 8 bits the converged ones, as expert_qmv's own rows."""
    from mlx_metaltile.ops.moe_gather_qmm import GEMV_SPEC

    assert all(c > 0 for c in _qmv_ptx_counts("activemask", GEMV_SPEC, 4))
    assert _qmv_ptx_counts("activemask", GEMV_SPEC, 8) == [0] * len(
        _qmv_ptx_counts("shfl.sync", GEMV_SPEC, 8))


@pytest.mark.skipif(nvcc_check.find_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME)")
def test_gemv_rows_round_weights_in_pairs():
    """moe_gather_qmm's GEMV rows round their weights to bfloat16 two per instruction
    (common.h's mt_round2 -> one cvt.rn.bf16x2.f32): per step of the loop 4 rows x 4 words x
    (codes per word / 2), with the row loop unrolled (no local-memory array). Negative
    controls: mt_round2 as two scalar conversions issues no paired one; the row loop without
    its pragma keeps its words in local memory."""
    from mlx_metaltile.ops.moe_gather_qmm import GEMV_SPEC

    for bits in (4, 8):
        pairs = _qmv_ptx_counts("cvt.rn.bf16x2.f32", GEMV_SPEC, bits)
        assert pairs and all(c >= 4 * 4 * (32 // bits) // 2 for c in pairs)
        assert _qmv_ptx_counts("__local_depot", GEMV_SPEC, bits) == [0] * len(pairs)
    with backends.template_override(
            GEMV_SPEC, ("return float2(vec<T, 2>(v));",
                        "return float2(float(T(v.x)), float(T(v.y)));")):
        assert _qmv_ptx_counts("cvt.rn.bf16x2.f32", GEMV_SPEC, 4) == [0] * len(pairs)
    with backends.template_override(GEMV_SPEC, ("  #pragma clang loop unroll(full)\n", "")):
        assert all(c > 0 for c in _qmv_ptx_counts("__local_depot", GEMV_SPEC, 4))


def _tile_code_loads(bits: int) -> list[int]:
    """Per kernel of moe_gather_qmm's bfloat16 affine tile instance at ``bits``: its vector
    loads of code words (16-byte at 8 bits; 8-byte at 4 bits, where x's 4 bfloat16 values
    per step also load as 8 bytes: 2 of them)."""
    spec = sys.modules["mlx_metaltile.ops.moe_gather_qmm"].SIMDGROUP_SPEC
    inst = nvcc_check.spec_instance(spec, T="bfloat16", BITS=bits, GROUP_SIZE=64, MODE=0)
    ptx = nvcc_check.ptx_text(nvcc_check.spec_unit(spec, [inst]))
    op = "ld.global.v4.u32" if bits == 8 else "ld.global.v2.u32"
    return [body.count(op) - (0 if bits == 8 else 2) for body in ptx.split(".entry ")[1:]]


@pytest.mark.skipif(nvcc_check.find_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME)")
def test_tile_lanes_load_their_codes_in_one_access():
    """moe_gather_qmm's tile kernel: each lane's code words of a step (its own weight row)
    come in one 16-byte (8 bits) or 8-byte (4 bits) load on CUDA, common.h's mt_load_codes:
    two per kernel, the first step's and the fetch of the next. Negative control: the words
    read one by one give no such load."""
    import mlx_metaltile.ops.moe_gather_qmm  # noqa: F401 (the module, not the op)

    for bits in (4, 8):
        counts = _tile_code_loads(bits)
        assert counts and all(c == 2 for c in counts), (bits, counts)
    spec = sys.modules["mlx_metaltile.ops.moe_gather_qmm"].SIMDGROUP_SPEC
    one_by_one = "for (uint j = 0; j < WORDS; ++j) { wq[j] = w_words[{s} * WORDS + j]; }"
    with backends.template_override(
            spec, ("mt_load_codes<WORDS>(w_words + step_begin * WORDS, wq);",
                   one_by_one.replace("{s}", "step_begin")),
            ("mt_load_codes<WORDS>(w_words + (step + 1) * WORDS, wq);",
             one_by_one.replace("{s}", "(step + 1)"))):
        assert _tile_code_loads(8) == [0] * len(counts)
        assert _tile_code_loads(4) == [0] * len(counts)


@pytest.mark.skipif(nvcc_check.find_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME)")
def test_and_or_is_one_lop3():
    """mt_and_or is one lop3 on CUDA: expert_qmv's affine decode issues one per code, at least
    16 words x 8 codes per step of its loop (ptxas would otherwise make two LOP3s of the
    plain expression, both constants immediates); the plain expression gives none in PTX."""
    import mlx_metaltile.ops.expert_qmv  # noqa: F401 (the module, not the op)

    counts = _qmv_lop3_counts()
    assert counts and all(c >= 16 * 8 for c in counts)
    qmv = sys.modules["mlx_metaltile.ops.expert_qmv"]
    with backends.template_override(
            qmv.SPEC, ("mt_and_or(part, MASK << (BITS * j), 0x4B000000u)",
                       "(part & (MASK << (BITS * j))) | 0x4B000000u")):
        assert _qmv_lop3_counts() == [0] * len(counts)


@pytest.mark.skipif(nvcc_check.find_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME)")
def test_ldmatrix_reads_only_threadgroup_memory():
    """mt_sg_load4 is one ldmatrix on CUDA, which reads shared memory only, and the translation
    erases address spaces: given device memory the kernel traps (a loud launch error, never
    a read of the wrong memory). Where the tile is provably threadgroup memory (sdpa_multi's
    MMA kernel) nvcc drops the check."""
    misuse = Feature(
        name="ldmatrix_device_pointer",
        header="#include <metal_stdlib>\nusing namespace metal;\n\n" + read_text("common.h"),
        source="""
simdgroup_matrix<half, 8, 8> a[4];
mt_sg_load4(a, (const threadgroup half*)(A), 40u, 8u);
simdgroup_store(a[0], D, 8);
""",
        inputs=(("A", mx.float16, 2),), outputs=(("D", mx.float16),))
    ptx = nvcc_check.ptx_text(feature_unit(misuse))
    assert "ldmatrix" in ptx and "trap" in ptx
    import mlx_metaltile.ops.sdpa_multi  # noqa: F401 (the module, not the op)

    sdpa = sys.modules["mlx_metaltile.ops.sdpa_multi"]
    inst = nvcc_check.spec_instance(sdpa.MMA_SPEC, T="bfloat16", D=128, PF=1, MASK_KIND=0)
    ptx = nvcc_check.ptx_text(nvcc_check.spec_unit(sdpa.MMA_SPEC, [inst]))
    assert "ldmatrix" in ptx and "trap" not in ptx and "isspacep" not in ptx


def test_prepared_launch_keeps_its_latest_layouts(monkeypatch):
    """A prepared launch given a new host-known scalar each call (a decode loop's kv_len)
    packs each call's own bits, and keeps only its latest layouts (one per value)."""
    from mlx_metaltile._msl import constants

    made = _KernelRecorder()
    monkeypatch.setattr(mx.fast, "cuda_kernel", made)
    k = cuda.metal_kernel("k", ["x", "kv", "n"], ["out"], "out[0] = x[0];")
    run = k.prepare_launch([None, None, constants.scalar(5, mx.uint32)],
                           output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                           threadgroup=(32, 1, 1), template=[])
    x = mx.zeros((4,))
    for n in (*range(1000, 1000 + cuda._LAYOUTS + 8), 1000, 1003):
        run([x, constants.scalar(n, mx.uint32)])
        name, kwargs = made.calls[-1]
        x_in, packed = kwargs["inputs"]
        assert name == "k_apupu" and x_in is x and packed.tolist()[:2] == [n, 5]
    assert len(run._layouts) == cuda._LAYOUTS
