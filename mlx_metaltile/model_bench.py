"""``python -m mlx_metaltile model-bench``: mlx-lm models at real layer shapes, native vs patched.

Builds mlx-lm's own class for an architecture with random weights at the published
model's layer shapes (a few layers), quantized as the published MLX checkpoints are, and
times decode, verification blocks and prefill with mlx-lm's code (native) and after
``mt.patch`` (patched), plus the largest logit difference, the kernels called and a
per-op time split of one patched decode step. Without a GPU kernel backend the patched
model runs the reference composites: those numbers are not kernel timings.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform
import sys
import time
from collections import Counter

import mlx.core as mx
import mlx.nn as nn

import mlx_metaltile as mt
from mlx_metaltile import _device, backends
from mlx_metaltile import nn as mtnn

_QWEN3_MOE = dict(  # Qwen3-30B-A3B
    hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6,
    vocab_size=151936, rope_theta=1e6, max_position_embeddings=40960,
    tie_word_embeddings=False)
_QWEN3_NEXT = dict(  # Qwen3-Next-80B-A3B
    hidden_size=2048, intermediate_size=5120, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
    num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6,
    vocab_size=151936, rope_theta=1e7, partial_rotary_factor=0.25,
    max_position_embeddings=262144, full_attention_interval=4, tie_word_embeddings=False)
_GPT_OSS = dict(  # gpt-oss-20b (mlx-lm's ModelArgs defaults are its shapes)
    num_local_experts=32, num_experts_per_tok=4, vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
    sliding_window=128, rope_theta=150000)
_MIXTRAL = dict(  # Mixtral-8x7B
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, rope_theta=1e6)
_GLM4_MOE = dict(  # GLM-4.5-Air: DeepSeek-V3's MoE block (the router's grouped top k, a
    # shared expert, first layer dense) with standard attention
    hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
    num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128,
    n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, n_group=1,
    topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, partial_rotary_factor=0.5,
    rope_theta=1e6, rope_scaling=None, rms_norm_eps=1e-5, vocab_size=151552,
    max_position_embeddings=131072, use_qk_norm=False, attention_bias=True,
    tie_word_embeddings=False)

# arch -> (config, experts' quantization, the other layers' quantization), as published:
# mlx-community 4-bit affine (group 64); gpt-oss: mxfp4 experts, 8-bit affine elsewhere.
ARCHS = {
    "qwen3_moe": (_QWEN3_MOE, ("affine", 64, 4), ("affine", 64, 4)),
    "qwen3_next": (_QWEN3_NEXT, ("affine", 64, 4), ("affine", 64, 4)),
    "gpt_oss": (_GPT_OSS, ("mxfp4", 32, 4), ("affine", 64, 8)),
    "mixtral": (_MIXTRAL, ("affine", 64, 4), ("affine", 64, 4)),
    "glm4_moe": (_GLM4_MOE, ("affine", 64, 4), ("affine", 64, 4)),
}
OPS = ("sdpa_multi", "expert_glu", "expert_qmv", "expert_down_combine", "moe_gather_qmm",
       "gated_rms_norm", "fp4_qmm")


def _native_sdpa_multi(q, k, v, *, scale, causal=False, kv_len=None, mask=None, sinks=None):
    # mlx-lm: mx.fast's attention over the cache's first offset rows (a slice); the patched
    # attention passes masks over those keys, as mlx-lm does
    if kv_len is not None:
        k, v = k[..., :kv_len, :], v[..., :kv_len, :]
    if causal:
        mask = "causal"
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def _native_kwargs(kwargs: dict) -> dict:
    """An op call's keywords for its native counterpart: a 0-d kv_len (the patched attention
    passes the cache's offset so) as the int mlx-lm slices the cache by."""
    kv_len = kwargs.get("kv_len")
    return dict(kwargs, kv_len=kv_len.item()) if isinstance(kv_len, mx.array) else kwargs


def _native_expert_qmv(x, w, scales, biases, indices, *, group_size=None, bits=None,
                       mode="affine"):
    # mlx-lm's QuantizedSwitchLinear: gather_qmm of x[..., None, None, :] (shared by the k
    # experts) or x[..., None, :] (one input per expert)
    x = mx.expand_dims(x, -2) if x.ndim == indices.ndim + 1 else mx.expand_dims(x, (-2, -3))
    return mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True,
                         group_size=group_size, bits=bits, mode=mode).squeeze(-2)


def _native_expert_glu(x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up,
                       indices, *, bias_gate=None, bias_up=None, activation="silu",
                       mode="affine", group_size=None, bits=None):
    from mlx_lm.models.activations import swiglu, swiglu_oai

    # mlx-lm's SwitchGLU up to its activation: gate and up gather_qmm, biases, SwiGLU or
    # SwigluOAI
    q = dict(group_size=group_size, bits=bits, mode=mode)
    gate = _native_expert_qmv(x, w_gate, scales_gate, biases_gate, indices, **q)
    up = _native_expert_qmv(x, w_up, scales_up, biases_up, indices, **q)
    if bias_gate is not None:
        gate, up = gate + bias_gate[indices], up + bias_up[indices]
    return swiglu(gate, up) if activation == "silu" else swiglu_oai(gate, up)


def _native_expert_down_combine(h, w, scales, biases, indices, scores, *, bias=None,
                                mode="affine", group_size=None, bits=None):
    # mlx-lm's down gather_qmm, then the MoE block's (y * scores[..., None]).sum(-2)
    y = _native_expert_qmv(h, w, scales, biases, indices, group_size=group_size, bits=bits,
                           mode=mode)
    if bias is not None:
        y = y + bias[indices]
    return (y * scores[..., None]).sum(axis=-2)


def _native_moe_gather_qmm(x, w, scales, biases, indices, *, group_size=None, bits=None,
                           mode="affine"):
    # mlx-lm's sorted path: gather_qmm over expert-sorted rows
    return mx.gather_qmm(mx.expand_dims(x, -2), w, scales, biases, rhs_indices=indices,
                         transpose=True, sorted_indices=True, group_size=group_size,
                         bits=bits, mode=mode).squeeze(-2)


def _native_gated_rms_norm(y, z, weight, eps=1e-5):
    from mlx_lm.models.activations import precise_swiglu

    # mlx-lm's Qwen3NextRMSNormGated
    return precise_swiglu(y, z, mx.fast.rms_norm(y, weight, eps))


def _native_fp4_qmm(x, w, scales, *, group_size=None, mode=None):
    # nn.QuantizedLinear
    return mx.quantized_matmul(x, w, scales, transpose=True, group_size=group_size, mode=mode)


# Each op's counterpart in mlx / mlx-lm, called with the op's own arguments: what the
# unpatched model runs for the same call.
NATIVE = {"sdpa_multi": _native_sdpa_multi, "expert_qmv": _native_expert_qmv,
          "expert_glu": _native_expert_glu, "expert_down_combine": _native_expert_down_combine,
          "moe_gather_qmm": _native_moe_gather_qmm, "gated_rms_norm": _native_gated_rms_norm,
          "fp4_qmm": _native_fp4_qmm}
_T0 = time.perf_counter()


def _progress(msg: str) -> None:
    """A progress line with the elapsed time, on a terminal only (logs stay clean)."""
    if sys.stderr.isatty():
        print(f"  [{time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def _random_experts(linear, mode: str, group_size: int, bits: int):
    """A QuantizedSwitchLinear of ``linear``'s shape holding random codes and scales, made
    without materialising float weights (512 experts of Qwen3-Next would be gigabytes)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    E, N, K = linear.weight.shape
    dtype = linear.weight.dtype
    q = QuantizedSwitchLinear(group_size, N, 1, "bias" in linear, group_size, bits, mode)
    words = (E, N, K * bits // 32)
    low, high = (mx.random.randint(0, 2**16, words).astype(mx.uint32) for _ in range(2))
    q.weight = mx.left_shift(high, 16) | low  # random codes
    groups = (E, N, K // group_size)
    if mode == "affine":  # W = s * (code - centre), std(W) about 0.02
        half = 2 ** (bits - 1)
        q.scales = (0.02 / (0.58 * half) * (1 + 0.1 * mx.random.normal(groups))).astype(dtype)
        q.biases = (-half * q.scales).astype(dtype)
    else:  # E8M0 exponents around 2^-8
        q.scales = mx.random.randint(118, 121, groups).astype(mx.uint8)
        q.biases = None
    if "bias" in linear:
        q.bias = linear.bias
    q.freeze()
    return q


def build(arch: str, layers: int, dtype=mx.bfloat16):
    """mlx-lm's Model for ``arch`` at the published layer shapes, ``layers`` layers."""
    config, (e_mode, e_gs, e_bits), (mode, gs, bits) = ARCHS[arch]
    config = dict(config, model_type=arch, num_hidden_layers=layers)
    if arch == "qwen3_next" and layers < config["full_attention_interval"]:
        config["full_attention_interval"] = layers  # keep one full-attention layer
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    switch = [(p, m) for p, m in model.named_modules() if type(m).__name__ == "SwitchLinear"]
    for path, linear in switch:
        _set(model, path, _random_experts(linear, e_mode, e_gs, e_bits))
    nn.quantize(model, group_size=gs, bits=bits, mode=mode,
                class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and type(m).__name__ != "SwitchLinear")
    for i, layer in enumerate(model.layers):
        mx.eval(layer.parameters())
        _progress(f"built layer {i + 1}/{layers}")
    mx.eval(model.parameters())
    model.eval()
    return model, config


def _set(root, path: str, value) -> None:
    """Put ``value`` at ``path`` ("model.layers.0.mlp.gate_proj") of a module tree."""
    *parents, last = path.split(".")
    node = root
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = value


def _make_cache(model):
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def _tokens(n: int, vocab: int, seed: int) -> mx.array:
    return mx.random.randint(0, vocab, (1, n), key=mx.random.key(seed))


def _timed(fn, iters: int) -> float:
    """Median seconds of ``fn()`` (which evaluates its result)."""
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def measure(model, vocab: int, context: int, prefill: int, iters: int) -> dict:
    """prefill tokens/s, and the logits of a decode step and of the prefill (decode, verify
    and mlx-lm's generate are timed by :func:`interleaved_steps`)."""
    cache = _make_cache(model)
    mx.eval(model(_tokens(context, vocab, 1), cache=cache))
    _progress(f"context of {context} tokens cached")
    logits = model(_tokens(1, vocab, 2), cache=cache)
    mx.eval(logits)
    prompt = _tokens(prefill, vocab, 9)
    prefill_logits = []

    def run_prefill():
        prefill_logits[:] = [model(prompt, cache=_make_cache(model))[:, -1]]
        mx.eval(prefill_logits)

    out = {"prefill_tok_s": prefill / _timed(run_prefill, max(1, iters // 4))}
    out["logits"] = (logits, prefill_logits[0])
    return out


STEPS = {"decode_ms": 1, "verify4_ms": 4, "verify8_ms": 8}  # key -> tokens per step
# Steps averaged in one sample: a step of a few layers takes 2 to 8 ms, mostly host time, and
# one step alone jitters by 10 to 20% between samples on a GPU host.
STEP_REPEATS = 8


def interleaved_steps(model, vocab: int, context: int, iters: int) -> dict[str, dict]:
    """Median ms of one decode step (1 token) and of verification steps (4 and 8 tokens)
    after ``context`` cached tokens, each step built and evaluated (a sample: the mean of
    ``STEP_REPEATS`` steps in a row, the cache rewound after each), and the median
    ``generate_tok_s`` of mlx-lm's generate, native and patched: {"native": {key: value},
    "patched": {key: value}}. The two sides' samples are taken in turns (a native round of
    the three steps and one generation, then a patched one, ``iters`` times; the first call
    of each step after a switch is not timed), so a drift of the GPU's clocks or of the
    host's load falls on both sides alike. Leaves the model patched."""
    cache = _make_cache(model)
    mx.eval(model(_tokens(context, vocab, 1), cache=cache))
    tokens = {key: _tokens(L, vocab, 2 if L == 1 else 3 + L) for key, L in STEPS.items()}
    samples = {side: {key: [] for key in (*STEPS, "generate_tok_s")}
               for side in ("native", "patched")}

    def step(tok) -> float:
        t = time.perf_counter()
        mx.eval(model(tok, cache=cache))
        seconds = time.perf_counter() - t
        _rewind(cache, tok.shape[1])
        return seconds

    for i in range(iters):
        for side in ("native", "patched"):
            mt.patch(model) if side == "patched" else mt.unpatch(model)
            for key, tok in tokens.items():
                step(tok)
                seconds = sum(step(tok) for _ in range(STEP_REPEATS))
                samples[side][key].append(1e3 * seconds / STEP_REPEATS)
            samples[side]["generate_tok_s"].append(
                _generate_tok_s(model, vocab, context, GENERATE_TOKENS))
        _progress(f"decode, verify and generate: round {i + 1}/{iters}")
    return {side: {key: sorted(t)[len(t) // 2] for key, t in values.items()}
            for side, values in samples.items()}


GENERATE_TOKENS = 64  # tokens generated after the prompt for generate_tok_s


def _generate_tok_s(model, vocab: int, context: int, tokens: int) -> float:
    """Decode tokens/s as mlx-lm generates: its own ``generate_step`` (greedy) after a
    prompt of ``context`` tokens, which builds step n + 1's graph while the GPU runs step n
    (``mx.async_eval``), so the host's and the GPU's time per token overlap; from the first
    token out (the prompt done) to the last."""
    from mlx_lm.generate import generate_step

    steps = generate_step(_tokens(context, vocab, 11)[0], model, max_tokens=tokens + 1)
    next(steps)
    t = time.perf_counter()
    n = sum(1 for _ in steps)
    return n / (time.perf_counter() - t)


def _rewind(cache, n: int) -> None:
    """Drop the last n positions where the cache can (recurrent states cannot)."""
    for c in cache:
        if c.is_trimmable():
            c.trim(n)


def _trimmable(model) -> bool:
    return all(c.is_trimmable() for c in _make_cache(model))


def op_split(model, vocab: int, context: int, iters: int) -> dict:
    """Kernel launches and time per op in one patched decode step: each op's recorded calls
    replayed alone with the same arguments, and so are their native counterparts
    (:data:`NATIVE`): sums of isolated calls, each evaluated on its own (no overlap with
    the rest of the step)."""
    recorded: list[tuple[str, tuple, dict]] = []
    originals = {name: getattr(mtnn, name) for name in OPS}

    def spy(name):
        def call(*args, **kwargs):
            recorded.append((name, args, kwargs))
            return originals[name](*args, **kwargs)
        return call

    cache = _make_cache(model)
    mx.eval(model(_tokens(context, vocab, 1), cache=cache))
    before = Counter(backends._launches)
    compiled = mtnn.COMPILED_BACKENDS
    mtnn.COMPILED_BACKENDS = ()  # a compiled replay would run no op's Python: nothing to see
    for name in OPS:
        setattr(mtnn, name, spy(name))
    try:
        mx.eval(model(_tokens(1, vocab, 2), cache=cache))
    finally:
        mtnn.COMPILED_BACKENDS = compiled
        for name, fn in originals.items():
            setattr(mtnn, name, fn)
    launches = Counter(backends._launches)
    launches.subtract(before)
    split = {}
    for name in OPS:
        calls = [(a, k) for n, a, k in recorded if n == name]
        if not calls:
            continue
        diff = 0.0
        calls = [(a, k, _native_kwargs(k)) for a, k in calls]
        for a, k, nk in calls:  # the counterpart computes the same thing
            got, want = originals[name](*a, **k), NATIVE[name](*a, **nk)
            if got.shape != want.shape:
                raise ValueError(f"[model-bench] internal: {name} gives {got.shape}, its "
                                 f"native counterpart {want.shape}")
            diff = max(diff, mx.abs(got.astype(mx.float32) - want.astype(mx.float32))
                       .max().item())
        split[name] = dict(calls=len(calls), max_abs_diff=diff, **{
            key: 1e3 * sum(_timed(lambda a=a, k=k, f=f: mx.eval(f(*a, **k)), iters)
                           for a, k in ((a, k if ours else nk) for a, k, nk in calls))
            for key, f, ours in (("ms", originals[name], True),
                                 ("native_ms", NATIVE[name], False))})
    return dict(launches={k: v for (_, k), v in launches.items() if v > 0}, split=split)


# --attention: which sdpa the patched model's attention runs. "auto": what
# mt.nn.sdpa_queries says for the backend; "sdpa_multi" / "mlx": every call on one side
# (how the per-backend table is measured).
ATTENTION = ("auto", "sdpa_multi", "mlx")


@contextlib.contextmanager
def attention_choice(choice: str, backend: str):
    """``mt.nn.SDPA_QUERIES_PER_BACKEND[backend]`` set for ``choice`` while inside."""
    if choice not in ATTENTION:
        raise ValueError(f"[model-bench] attention must be one of {ATTENTION}, got {choice!r}")
    if choice == "auto":
        yield
        return
    served = {} if choice == "sdpa_multi" else {d: range(0) for d in mtnn.SDPA_HEAD_DIMS}
    with mtnn.backend_entry(mtnn.SDPA_QUERIES_PER_BACKEND, backend, served):  # {}: every L
        yield


def run(args) -> int:
    with attention_choice(args.attention, backends.resolve_backend()):
        return _run(args)


def _run(args) -> int:
    try:
        import mlx_lm
    except ImportError:
        print("model-bench needs mlx-lm: pip install 'mlx-metaltile[mlx-lm]'", file=sys.stderr)
        return 2
    backend = backends.resolve_backend()
    gpu = backend in ("metal", "cuda")
    iters = args.iters or (10 if gpu else 1)
    context = args.context or (1024 if gpu else 16)
    prefill = args.prefill or (512 if gpu else 8)
    device = _device.device_name()
    print(f"model-bench {args.arch}  layers {args.layers}  mlx {mx.__version__}  mlx-lm "
          f"{mlx_lm.__version__}  device: {device}  backend: {backend}  attention: "
          f"{args.attention}")
    if not gpu:
        print("NOTE: no GPU kernel backend here: the patched model runs "
              f"{backend} code, so these numbers are not kernel timings")
    _progress("building the model")
    model, config = build(args.arch, args.layers)
    vocab = config["vocab_size"]
    if not _trimmable(model):
        print("note: this model's caches cannot be rewound; decode/verify samples "
              "grow the context by one step each")
    _progress("native: decode, verify, prefill")
    native = measure(model, vocab, context, prefill, iters)
    report = mt.patch(model)
    print(report)
    fallbacks_before = mtnn.fallbacks.copy()
    _progress("patched: decode, verify, prefill")
    patched = measure(model, vocab, context, prefill, iters)
    _progress("patched: per-op split of a decode step")
    ops = op_split(model, vocab, context, iters)
    _progress("decode, verify and generate, native and patched in turns")
    steps = interleaved_steps(model, vocab, context, iters)
    native.update(steps["native"])
    patched.update(steps["patched"])
    mt.unpatch(model)
    fallbacks = mtnn.fallbacks - fallbacks_before
    ops["fallbacks"] = {f"{kind}: {why}": n for (kind, why), n in fallbacks.items()}
    diff = max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
               for a, b in zip(native.pop("logits"), patched.pop("logits"), strict=True))
    print(f"{'':<16}{'native':>12}{'patched':>12}{'ratio':>8}")
    for key, unit in (("decode_ms", "ms/token"), ("verify4_ms", "ms"), ("verify8_ms", "ms"),
                      ("prefill_tok_s", "tokens/s"),
                      ("generate_tok_s", f"tokens/s (mlx-lm's generate, {GENERATE_TOKENS})")):
        ratio = (native[key] / patched[key] if key.endswith("_ms")
                 else patched[key] / native[key])
        print(f"{key:<16}{native[key]:>12.3f}{patched[key]:>12.3f}{ratio:>7.2f}x  {unit}")
    print(f"decode, verify and generate: medians of {iters} samples per side (a step's: the "
          f"mean of {STEP_REPEATS} steps), native and patched samples taken in turns")
    print(f"max |logit difference| (bfloat16 model, decode and prefill): {diff:.4g}")
    print("kernel launches in one patched decode step: "
          + (", ".join(f"{k} x{v}" for k, v in sorted(ops["launches"].items())) or "none"))
    for what, n in ops["fallbacks"].items():
        print(f"  ran mlx-lm's path {n} times ({what})")
    if ops["split"]:
        print("per op in one patched decode step (its calls replayed alone; native: mlx's "
              "op on the same arguments):")
    for name, s in ops["split"].items():
        print(f"  {name:<16} {s['calls']:>3} calls  {s['ms']:8.3f} ms "
              f"({100 * s['ms'] / patched['decode_ms']:.0f}% of the step)  native "
              f"{s['native_ms']:8.3f} ms  {s['native_ms'] / s['ms']:5.2f}x")
    if args.json:
        meta = dict(arch=args.arch, layers=args.layers, device=device, backend=backend,
                    kernel_timings=gpu, mlx_version=mx.__version__,
                    mlx_lm_version=mlx_lm.__version__, package_version=mt.__version__,
                    git_sha=_device.git_sha(), platform=platform.platform(),
                    time=time.strftime("%Y-%m-%dT%H:%M:%S"), iters=iters, context=context,
                    prefill=prefill, attention=args.attention)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, native=native, patched=patched, max_logit_diff=diff,
                           report=[e.__dict__ for e in report.entries], **ops), f, indent=1)
        print(f"saved to {args.json}")
    return 0


def add_parser(sub) -> None:
    """The ``model-bench`` subcommand of ``python -m mlx_metaltile``."""
    p = sub.add_parser("model-bench", help="an mlx-lm model at real shapes, native vs patched")
    p.add_argument("--arch", required=True, choices=sorted(ARCHS))
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--backend", choices=backends.BACKENDS, help="default: auto")
    p.add_argument("--context", type=int, help="cached tokens before decode/verify "
                   "(default 1024 on a GPU, 16 elsewhere)")
    p.add_argument("--prefill", type=int, help="prompt tokens timed for prefill "
                   "(default 512 on a GPU, 8 elsewhere)")
    p.add_argument("--iters", type=int, help="timed samples (default 10 on a GPU, 1 elsewhere)")
    p.add_argument("--attention", choices=ATTENTION, default="auto",
                   help="the patched attention's sdpa: auto (mt.nn.sdpa_queries per backend "
                   "and head dim), sdpa_multi or mlx for every call")
    p.add_argument("--json", metavar="PATH", help="save results with device and versions")
    p.set_defaults(fn=run, parser=p)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_metaltile.model_bench")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["model-bench", *(argv if argv is not None else sys.argv[1:])])
    scope = mt.use_backend(args.backend) if args.backend else contextlib.nullcontext()
    with scope:  # as ``python -m mlx_metaltile model-bench``: --backend for this run only
        return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
