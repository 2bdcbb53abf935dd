"""quantlib.distributed on 2 and 4 CPU processes (gloo): what every rank holds after the sync, and that
every failure makes every rank raise the same error instead of hanging."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import quantlib as ql
from quantlib.distributed import AmaxSyncError
from tests.ranks import RankFailure, RankTimeout, run_on_ranks

from . import _layouts as L

pytestmark = pytest.mark.distributed


def _calibrate(
    rank: int,
    world: int,
    layout_name: str,
    policy: str = "max_of_peers",
    sync_w: bool = False,
    tokens=L.all_tokens,
    poison=None,
    disable=None,
    device="cpu",
):
    """Calibrate this rank's model with the sync; returns ("ok", amax table) or ("error", message)."""
    layout = L.LAYOUTS[layout_name]
    state = L.parallel_state(layout, rank)
    cfg = L.config(policy, sync_w)
    model, loop = L.build(layout, rank, cfg, tokens, poison, device=f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu")
    if disable is not None and rank == disable[0]:
        ql.disable_quantizer(model, disable[1])
    try:
        ql.calibrate(model, "max", loop, parallel_state=state)
    except AmaxSyncError as exc:
        return "error", str(exc), L.amax_table(model)
    return "ok", L.amax_table(model)


def _check_layout(layout_name: str, sync_w: bool = False, tokens=L.all_tokens, backend: str = "gloo") -> None:
    layout = L.LAYOUTS[layout_name]
    device = "cuda" if backend == "nccl" else "cpu"
    outs = run_on_ranks(
        _calibrate, layout.world, layout_name, "max_of_peers", sync_w, tokens, None, None, device, timeout=120, backend=backend
    )
    per_expert = {}
    for rank, out in enumerate(outs):
        assert out[0] == "ok", out[1]
        L.assert_matches(out[1], L.expected(layout, rank, tokens, sync_w), rank)
        ep_rank = layout.coord("expert", rank)[0]
        for i in range(L.N_LOCAL):
            per_expert.setdefault(ep_rank * L.N_LOCAL + i, out[1][f"layers.0.mlp.experts.local_experts.{i}.linear_fc2.weight_quantizer"][1])
    values = [tuple(v) for v in per_expert.values()]
    if sync_w:
        assert len(set(values)) == 1
    else:  # experts keep their own weight amax (their magnitudes differ by design)
        assert len(set(values)) == len(values) == layout.coord("expert", 0)[1] * L.N_LOCAL


@pytest.mark.parametrize("layout_name", ["DP2", "TP2", "EP2", "DP2xEP2", "TP2xEP2", "TP2xEP2_ETP1"])
def test_layout_amax_exact(layout_name):
    _check_layout(layout_name)


_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")


@pytest.mark.gpu
@_TWO_GPUS
@pytest.mark.parametrize("layout_name", ["DP2", "TP2", "EP2"])
def test_layout_amax_exact_nccl(layout_name):
    _check_layout(layout_name, backend="nccl")


@pytest.mark.gpu
@_TWO_GPUS
def test_nan_activation_raises_on_all_ranks_nccl():
    outs = run_on_ranks(_calibrate, 2, "EP2", "max_of_peers", False, L.all_tokens, (1, 1, "fc2"), None, "cuda", timeout=120, backend="nccl")
    msg = _same_error_everywhere(outs)
    assert "rank 1: layers.1.fc2.input_quantizer" in msg and "rank 0:" not in msg


@pytest.mark.parametrize("layout_name", ["EP2", "TP2xEP2"])
def test_sync_expert_weight_amax(layout_name):
    _check_layout(layout_name, sync_w=True)


def _same_error_everywhere(outs: list) -> str:
    assert all(o[0] == "error" for o in outs), [o[:2] for o in outs]
    messages = {o[1] for o in outs}
    assert len(messages) == 1, messages
    return messages.pop()


def _no_tokens_rank1_expert0(rank: int, layer: int, expert: int) -> bool:
    return not (rank == 1 and layer == 0 and expert == 0)


def _no_tokens_rank1_layer0(rank: int, layer: int, expert: int) -> bool:
    return not (rank == 1 and layer == 0)


def _no_tokens_layer0(rank: int, layer: int, expert: int) -> bool:
    return layer != 0


def test_expert_without_tokens_policy_error_raises_on_all_ranks():
    start = time.monotonic()
    outs = run_on_ranks(_calibrate, 2, "EP2", "error", False, _no_tokens_rank1_expert0, timeout=30)
    msg = _same_error_everywhere(outs)
    assert "rank 1" in msg and "rank 0" not in msg
    assert "layers.0.mlp.experts.local_experts.0.linear_fc1.input_quantizer" in msg and "expert_input_policy='error'" in msg
    assert time.monotonic() - start < 30
    # calibrate() is all or nothing: the failed run leaves rank 0's quantizers as they were before it (no amax)
    assert outs[0][2]["layers.0.fc1.input_quantizer"] is None


@pytest.mark.parametrize("layout_name", ["EP2", "DP2xEP2"])
def test_expert_without_tokens_max_of_peers_filled(layout_name):
    # rank 1: one expert without tokens (filled from its local peer, then synced), and in another run no
    # expert of layer 0 with tokens at all (filled from the remote experts)
    _check_layout(layout_name, tokens=_no_tokens_rank1_expert0)
    _check_layout(layout_name, tokens=_no_tokens_rank1_layer0)


def test_no_tokens_on_any_rank_raises_on_all_ranks():
    outs = run_on_ranks(_calibrate, 2, "EP2", "max_of_peers", False, _no_tokens_layer0, timeout=30)
    msg = _same_error_everywhere(outs)
    assert "layers.0.mlp.experts.local_experts.*.linear_fc1.input_quantizer" in msg and "any rank" in msg


def test_skip_policy_leaves_expert_dynamic():
    outs = run_on_ranks(_calibrate, 2, "EP2", "skip", False, _no_tokens_rank1_expert0, timeout=30)
    assert outs[1][0] == "ok"
    assert outs[1][1]["layers.0.mlp.experts.local_experts.0.linear_fc1.input_quantizer"] is None
    want = L.expected(L.LAYOUTS["EP2"], 1, _no_tokens_rank1_expert0)["layers.0.mlp.experts.local_experts.1.linear_fc1.input_quantizer"]
    assert outs[1][1]["layers.0.mlp.experts.local_experts.1.linear_fc1.input_quantizer"][1] == [want.item()]
    assert outs[0][1]["layers.0.mlp.experts.local_experts.0.linear_fc1.input_quantizer"][1] == [want.item()]


@pytest.mark.parametrize("layout_name, bad_rank", [("DP2", 1), ("TP2xEP2", 2)])
def test_nan_activation_raises_on_all_ranks(layout_name, bad_rank):
    layout = L.LAYOUTS[layout_name]
    start = time.monotonic()
    outs = run_on_ranks(_calibrate, layout.world, layout_name, "max_of_peers", False, L.all_tokens, (bad_rank, 1, "fc2"), timeout=30)
    msg = _same_error_everywhere(outs)
    assert f"rank {bad_rank}: layers.1.fc2.input_quantizer" in msg and "NaN" in msg
    assert [r for r in range(layout.world) if f"rank {r}:" in msg] == [bad_rank]
    assert time.monotonic() - start < 30


def _weights_only(rank: int, world: int):
    state = L.parallel_state(L.LAYOUTS["DP2"], rank)
    model, _ = L.build(L.LAYOUTS["DP2"], rank, L.config())
    try:
        ql.calibrate(model, "max", None, parallel_state=state)
    except AmaxSyncError as exc:
        return str(exc)


def test_static_inputs_without_forward_loop_raise_on_all_ranks():
    """Enabled static input quantizers need calibration data: without a forward loop, every rank says so."""
    msgs = run_on_ranks(_weights_only, 2, timeout=30)
    assert msgs[0] == msgs[1] and "layers.0.fc1.input_quantizer: no amax" in msgs[0] and "rank 1" in msgs[0]


def test_structure_mismatch_raises_on_all_ranks():
    outs = run_on_ranks(_calibrate, 2, "TP2", "max_of_peers", False, L.all_tokens, None, (1, "layers.0.fc1.input_quantizer"), timeout=30)
    msg = _same_error_everywhere(outs)
    assert "quantizers differ" in msg and "tensor group [0, 1]" in msg


def test_structure_mismatch_names_the_first_differing_quantizer():
    """Rank 1 disabled one input quantizer: the error names it, not only the ranks."""
    outs = run_on_ranks(_calibrate, 2, "TP2", "max_of_peers", False, L.all_tokens, None, (1, "layers.0.fc1.input_quantizer"), timeout=30)
    msg = _same_error_everywhere(outs)
    assert "first differing quantizer" in msg and "layers.0.fc1.input_quantizer" in msg, msg
    assert "rank 0:" in msg and "rank 1:" in msg  # each side names where its list departs from the other's


def _calibrate_with_bad_batch(rank: int, world: int, layout_name: str, bad_rank: int):
    """Rank ``bad_rank``'s forward loop raises a KeyError (a bad batch) after its first forward."""
    layout = L.LAYOUTS[layout_name]
    state = L.parallel_state(layout, rank)
    model, loop = L.build(layout, rank, L.config())

    def failing_loop(m):
        loop(m)
        if rank == bad_rank:
            raise KeyError("batch 3 has no 'input_ids'")

    start = time.monotonic()
    try:
        ql.calibrate(model, "max", failing_loop, parallel_state=state)
    except Exception as exc:  # noqa: BLE001  (which class each rank raises is the point)
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


@pytest.mark.parametrize("layout_name, bad_rank", [("DP2", 1), ("TP2xEP2", 2)])
def test_one_ranks_forward_loop_error_raises_promptly_on_every_rank(layout_name, bad_rank):
    """A non-calibration error on one rank (bad batch, OOM) must not leave the others waiting in the sync
    until the process-group timeout: that rank raises its own exception, every other rank an
    AmaxSyncError naming it."""
    outs = run_on_ranks(_calibrate_with_bad_batch, L.LAYOUTS[layout_name].world, layout_name, bad_rank, timeout=60)
    assert outs[bad_rank][0] == "KeyError" and "no 'input_ids'" in outs[bad_rank][1]
    others = [o for r, o in enumerate(outs) if r != bad_rank]
    assert all(kind == "AmaxSyncError" for kind, _, _ in others), others
    assert all(f"rank {bad_rank}: KeyError while calibrating" in msg and "input_ids" in msg for _, msg, _ in others), others
    assert max(elapsed for _, _, elapsed in outs) < 20  # the process groups' timeout is 60 s


# ------------------------------------------------------------------------------------ block amax over TP


def _row_parallel_int4(rank: int, world: int, in_local: int):
    """A row-parallel linear of 8 x (2 * in_local) inputs, this rank holding its half of the columns,
    INT4 blocks of 128 along the inputs; returns the synced block amax or the error."""
    full = torch.randn(8, 2 * in_local, generator=torch.Generator().manual_seed(0))
    model = ql.convert(torch.nn.Sequential(torch.nn.Linear(in_local, 8, bias=False)))
    model[0].parallel_role = "row"
    with torch.no_grad():
        model[0].weight.copy_(full[:, rank * in_local : (rank + 1) * in_local])
    try:
        ql.quantize(model, ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, None, parallel_state=ql.ParallelState(tensor_group=dist.group.WORLD))
    except AmaxSyncError as exc:
        return str(exc)
    return model[0].weight_quantizer.amax, full


def test_row_parallel_block_spanning_the_split_is_reduced_over_tp():
    """in_features 2 x 32 <= 128: one block covers the whole row at TP=1, so at TP=2 both ranks hold its MAX."""
    (a0, full), (a1, _) = run_on_ranks(_row_parallel_int4, 2, 32, timeout=30)
    assert a0.shape == (8, 1) and torch.equal(a0, a1)
    assert torch.equal(a0, full.abs().amax(dim=1, keepdim=True))


def test_row_parallel_blocks_within_a_shard_stay_per_rank():
    (a0, full), (a1, _) = run_on_ranks(_row_parallel_int4, 2, 128, timeout=30)
    assert torch.equal(a0, full[:, :128].abs().amax(dim=1, keepdim=True))
    assert torch.equal(a1, full[:, 128:].abs().amax(dim=1, keepdim=True))


def test_row_parallel_blocks_straddling_the_shards_raise_on_all_ranks():
    msgs = run_on_ranks(_row_parallel_int4, 2, 96, timeout=30)
    assert isinstance(msgs[0], str) and msgs[0] == msgs[1]
    assert "0.weight_quantizer" in msgs[0] and "straddle" in msgs[0] and "96" in msgs[0]


# ------------------------------------------------------------------------------------ batching


def _count_collectives(rank: int, world: int, n_layers: int, poison):
    layout = L.LAYOUTS["TP2xEP2"]
    state = L.parallel_state(layout, rank)
    model, loop = L.build(layout, rank, L.config(), L.all_tokens, poison, n_layers=n_layers)
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append((tensor.dtype, tensor.numel()))
        return real(tensor, *args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("sync_amax must use all_reduce only")

    saved = {n: getattr(dist, n) for n in ("broadcast", "all_gather", "all_gather_object", "gather", "reduce", "barrier")}
    dist.all_reduce = counting
    for n in saved:
        setattr(dist, n, forbidden)
    try:
        ql.calibrate(model, "max", loop, parallel_state=state)
        status = "ok"
    except AmaxSyncError:
        status = "error"
    finally:
        dist.all_reduce = real
        for n, f in saved.items():
            setattr(dist, n, f)
    return status, [(str(d), n) for d, n in calls]


@pytest.mark.parametrize("n_layers", [2, 8])
def test_collectives_are_batched(n_layers):
    outs = run_on_ranks(_count_collectives, 4, n_layers, None, timeout=60)
    for status, calls in outs:
        assert status == "ok"
        # 4 groups of 2 ranks: one int64 check + one fp32 payload each, whatever the number of quantizers
        assert [d for d, _ in calls] == ["torch.int64"] * 4 + ["torch.float32"] * 4, calls
    assert len({tuple(c) for _, c in outs}) <= 2  # the same sequence on every rank (sizes per group kind)


def test_collectives_on_error_path():
    outs = run_on_ranks(_count_collectives, 4, 2, (3, 0, "fc1"), timeout=60)
    for status, calls in outs:
        assert status == "error"
        assert [d for d, _ in calls] == ["torch.int64"] * 4 + ["torch.float32"] * 4 + ["torch.uint8"] * 4, calls


# ------------------------------------------------------------------------------------ direct use


def _sync_direct(rank: int, world: int):
    layout = L.LAYOUTS["EP2"]
    state = L.parallel_state(layout, rank)
    model, _ = L.build(layout, rank, L.config())
    experts = model.layers[0].mlp.experts.local_experts
    for m in model.modules():  # weights only; give the activation quantizers a value by hand
        if isinstance(m, ql.QuantModule):
            m.calibrate_weights()
            m.input_quantizer.amax = torch.tensor(1.0)
    experts[0].linear_fc1.input_quantizer.amax = torch.tensor(2.0 + rank)
    ql.sync_amax(model, state)
    return [e.linear_fc1.input_quantizer.amax.item() for e in experts], model.layers[1].mlp.experts.local_experts[
        0
    ].linear_fc1.input_quantizer.amax.item()


def test_sync_amax_directly():
    outs = run_on_ranks(_sync_direct, 2, timeout=30)
    assert outs == [([3.0, 3.0], 1.0), ([3.0, 3.0], 1.0)]


def test_single_rank_state_unifies_local_experts_without_collectives():
    layout = L.Layout("single", 1)
    model, loop = L.build(layout, 0, L.config())
    ql.calibrate(model, "max", loop, parallel_state=ql.ParallelState())
    L.assert_matches(L.amax_table(model), L.expected(layout, 0), 0)


def test_single_rank_state_raises_locally():
    layout = L.Layout("single", 1)
    model, loop = L.build(layout, 0, L.config(), poison=(0, 0, "fc2"))
    with pytest.raises(AmaxSyncError, match=r"rank 0: layers\.0\.fc2\.input_quantizer: calibration saw NaN"):
        ql.calibrate(model, "max", loop, parallel_state=ql.ParallelState())


# ------------------------------------------------------------------------------------ ParallelState


def test_parallel_state_defaults():
    s = ql.ParallelState()
    assert (s.data_size, s.tensor_size, s.expert_size, s.expert_tensor_size) == (1, 1, 1, 1)
    assert (s.data_rank, s.tensor_rank, s.expert_rank, s.expert_tensor_rank) == (0, 0, 0, 0)
    assert s.data_group is None and "data=0/1" in repr(s)


def _state_sizes(rank: int, world: int):
    state = L.parallel_state(L.LAYOUTS["TP2xEP2"], rank)
    whole = dist.new_group([0, 1, 2, 3])
    other = dist.new_group([0, 1])
    try:
        ql.ParallelState(data_group=other)
        not_member = None
    except ValueError as exc:
        not_member = str(exc)
    return (
        state.data_size,
        state.data_rank,
        state.tensor_rank,
        state.expert_rank,
        state.expert_tensor_rank,
        state.global_ranks("data"),
        ql.ParallelState(whole).data_size,
        not_member,
    )


def test_parallel_state_sizes_and_ranks():
    outs = run_on_ranks(_state_sizes, 4, timeout=30)
    assert [o[:6] for o in outs] == [(2, 0, 0, 0, 0, [0, 2]), (2, 0, 1, 0, 1, [1, 3]), (2, 1, 0, 1, 0, [0, 2]), (2, 1, 1, 1, 1, [1, 3])]
    assert all(o[6] == 4 for o in outs)
    assert outs[0][7] is None and "not a member" in outs[2][7]


def test_from_megatron_not_initialized():
    pytest.importorskip("megatron.core")
    with pytest.raises(RuntimeError, match="not initialized"):
        ql.ParallelState.from_megatron()


def _megatron_state(rank: int, world: int):
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    try:
        state = ql.ParallelState.from_megatron()
        layout = L.LAYOUTS["TP2xEP2"]
        ranks = {n: state.global_ranks(n) for n in ("data", "tensor", "expert", "expert_tensor")}
        assert ranks == {n: list(layout.members(n, rank)) for n in ranks}, ranks
        model, loop = L.build(layout, rank, L.config())
        ql.calibrate(model, "max", loop, parallel_state=state)
        return L.amax_table(model)
    finally:
        mpu.destroy_model_parallel()


@pytest.mark.megatron
def test_from_megatron_tp2_ep2():
    pytest.importorskip("megatron.core")
    outs = run_on_ranks(_megatron_state, 4, timeout=60)
    for rank, table in enumerate(outs):
        L.assert_matches(table, L.expected(L.LAYOUTS["TP2xEP2"], rank), rank)


# ------------------------------------------------------------------------------------ the harness


def _hang(rank: int, world: int):
    if rank == 0:
        dist.all_reduce(torch.zeros(1))
    time.sleep(60)


def test_harness_kills_a_hang():
    start = time.monotonic()
    with pytest.raises((RankTimeout, RankFailure)):
        run_on_ranks(_hang, 2, timeout=3)
    assert time.monotonic() - start < 15


# ------------------------------------------------------------------------------------ grouped experts


def _calibrate_grouped(rank: int, world: int, sync_w: bool, tokens):
    layout = L.LAYOUTS["EP2"]
    state = L.parallel_state(layout, rank)
    cfg = {
        "quant_cfg": {
            "*weight_quantizer": {"num_bits": 8, "axis": 0},
            "*input_quantizer": {"num_bits": 8, "axis": None},
            "default": {"enable": False},
        },
        "sync_expert_weight_amax": sync_w,
    }
    model = ql.quantize(L.GroupedNet(layout, rank), cfg, L.grouped_loop(rank, tokens), parallel_state=state)
    return L.amax_table(model)


@pytest.mark.parametrize("sync_w", [False, True])
@pytest.mark.parametrize("tokens", [L.all_tokens, _no_tokens_rank1_layer0], ids=["all", "rank1-layer0-none"])
def test_grouped_experts(sync_w, tokens):
    """A module holding all local experts (GroupedQuantizer weights, one input quantizer): one input
    amax per layer across ranks; member i keeps expert i's weight amax."""
    outs = run_on_ranks(_calibrate_grouped, 2, sync_w, tokens, timeout=60)
    for rank, table in enumerate(outs):
        L.assert_matches(table, L.grouped_expected(L.LAYOUTS["EP2"], rank, tokens, sync_w), rank)
