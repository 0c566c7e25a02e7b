"""A patched model sharded by mlx-lm over mx.distributed: two ranks on 127.0.0.1.

Each rank (tests/shard_worker.py) runs the architecture's own tensor-parallel ``shard()``
(qwen3_moe: attention projections by ``shard_linear``, heads halved, experts by
``shard_inplace`` with the MoE block's all-reduce; qwen3: attention and MLP by
``shard_linear``; qwen3_5_moe: also the Gated-DeltaNet layers' heads in place and the
vocabulary), in both orders (patch then shard; shard then patch), on the emulator backend,
and compares the logits with the unsharded patched model's.

Bound (argued, not fitted): sharding splits the sums behind each sharded-to-all layer
(``o_proj``, the experts' down projection, the dense ``down_proj``, Gated-DeltaNet's
``out_proj``) into one partial sum per rank, added by the all-reduce: another rounding
order of the same float32 sum, within the table's ``accum`` (2e-6 relative to the
magnitude behind it). All-to-sharded layers compute whole rows per rank as before. A
changed rounding order in one module of a pre-norm residual stack reaches the logits with
a gain of about one; with ``n`` = modules whose summation order may change (the stand-ins
live in the sharded model, counted as tests/test_patch.py counts replaced modules, plus
sharded-to-all layers and modules holding a sharding group), the two differ by at most
``2 * accum * n * max|logits|``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_metaltile._registry import TOLERANCES

pytest.importorskip("mlx_lm")

RANKS = 2
TIMEOUT_S = 150  # the whole run takes 15-40 s on two CPU cores
ARCHS = ("qwen3_moe", "qwen3", "qwen3_5_moe")
WORKER = Path(__file__).resolve().parent / "shard_worker.py"


def _ring_skip_reason() -> str | None:
    try:
        available = mx.distributed.is_available("ring")
    except TypeError:  # an MLX without per-backend availability
        available = False
    if not available:
        return "this MLX build has no ring backend (mx.distributed.is_available('ring'))"
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        return f"no loopback sockets for the ring backend: {e}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run the worker on RANKS processes over the ring backend; each rank's results."""
    reason = _ring_skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("shard")
    hostfile = out / "hosts.json"  # MLX's ring hostfile: one ["ip:port"] per rank
    hostfile.write_text(json.dumps([[f"127.0.0.1:{_free_port()}"] for _ in range(RANKS)]))
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), str(out), "emulator"], cwd=WORKER.parent.parent,
        env=dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(RANKS)]
    try:
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def _cases(ranks):
    for rank in ranks:
        assert rank["size"] == RANKS
        for case in rank["cases"]:
            yield rank["rank"], case


def _bound(case) -> float:
    live = dict(case["live"], moe_block=0)  # a block and its SwitchGLU count once
    n = sum(live.values()) + case["sharded_to_all"]
    return 2 * TOLERANCES["float32"].accum * n * case["scale"]


def test_both_orders_match_the_unsharded_patched_model(ranks):
    seen = set()
    for rank, case in _cases(ranks):
        seen.add((case["arch"], case["order"]))
        assert case["sharded_to_all"] > 0, case  # shard() ran
        assert case["launched"] > 0 and case["fallbacks"] == 0, case  # the kernels ran
        for err in case["errs"]:
            assert err <= _bound(case), (rank, case["arch"], case["order"], err, _bound(case))
    assert seen == {(a, o) for a in ARCHS
                    for o in ("patch-shard", "shard-patch")}


def test_a_missing_all_reduce_fails_the_bound(ranks):
    """The comparison can fail: one MoE block without its all-reduce."""
    for _, case in _cases(ranks):
        if "control_errs" in case:
            assert max(case["control_errs"]) > 100 * _bound(case), case


def test_what_stays_served(ranks):
    """Attention, experts and gated norms stay patched in both orders. ``shard_linear``
    replaces linear layers by mlx's tensor-parallel ones: a patch after sharding serves
    them (mxfp4 here), a patch before sharding cannot (they did not exist yet)."""
    served = {"qwen3_moe": {"attention": 2, "moe_block": 2, "switch_glu": 2},
              "qwen3_5_moe": {"attention": 1, "gated_rms_norm": 1, "moe_block": 2,
                              "switch_glu": 2},
              # 7 linear layers a decoder layer, and the (unsharded) LM head
              "qwen3": {"attention": 2, "fp4_linear": 15}}
    for _, case in _cases(ranks):
        want = dict(served[case["arch"]])
        if case["order"] == "patch-shard" and case["arch"] == "qwen3":
            want["fp4_linear"] = 1  # the LM head; the report still lists all 15
            assert case["replaced"] == 17, case
        assert case["live"] == want, case
        assert case["left"] == {}, case
