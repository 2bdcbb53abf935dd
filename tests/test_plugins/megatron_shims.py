"""Test-only shims and helpers that run Megatron-Core 0.16.1 on the CPU with gloo (see shared/FACTS.md).

Nothing here is imported by the library. Megatron is imported lazily so that collecting the tests
without it stays cheap (the tests skip through ``pytest.importorskip``).
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable, Optional

import torch

from tests.ranks import die_with_parent, run_on_ranks

_SHIMS_APPLIED = False


def apply_cpu_shims() -> None:
    """Make Megatron-Core 0.16.1 run on the CPU: (1) ``torch.cuda.current_device()`` gives the CPU
    device, (2) the undefined ``moe_utils.te_general_gemm`` becomes None, (4) ``torch.cuda.synchronize``
    is a no-op (dist checkpointing calls it); (3) needs no patch: tests seed with
    ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``. Idempotent; only ever called from tests."""
    global _SHIMS_APPLIED
    if _SHIMS_APPLIED:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _SHIMS_APPLIED = True


def fast_checkpoint_writer() -> None:
    """Dist checkpointing starts a ``spawn`` multiprocessing Manager for its write results (seconds: the
    child re-imports torch); hand it one started by ``fork`` instead. Test-only speed-up."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _MANAGER
    if filesystem_async._results_queue is None:
        from multiprocessing.managers import SyncManager

        _MANAGER = SyncManager(ctx=mp.get_context("fork"))
        _MANAGER.start(initializer=die_with_parent)
        filesystem_async._results_queue = _MANAGER.Queue()


_MANAGER = None


def _rank_setup() -> None:
    apply_cpu_shims()
    fast_checkpoint_writer()


def _rank_teardown() -> None:
    if _MANAGER is not None:
        _MANAGER.shutdown()


def run_distributed(fn: Callable, world: int, *args, timeout: float = 240.0, method: Optional[str] = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks with the CPU shims applied; return the
    results by rank. Megatron must already be imported in the parent (fork, FACTS.md). ``method="spawn"``: fresh
    interpreters instead (``fn`` importable by name), for a parent whose threads a forked child cannot use."""
    return run_on_ranks(fn, world, *args, timeout=timeout, setup=_rank_setup, teardown=_rank_teardown, method=method)


# ------------------------------------------------------------------------------------ a small MoE GPT

VOCAB, SEQ = 64, 8
#: name -> (tensor parallel, expert parallel); a world of 4 ranks takes the rest as data parallel
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "ep2": (1, 2), "tp2ep2": (2, 2), "ep4": (1, 4)}


def _destroy_subgroups() -> None:
    """Destroy every process group but the default one. ``destroy_model_parallel`` only drops Megatron's
    references: each gloo group keeps its threads (three per group) until destroyed, and a sweep of layouts
    piled up over a thousand threads per rank polling every 10 ms, enough to stall a 2-core machine."""
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    for group in [g for g in list(c10d._world.pg_map) if g is not default]:
        torch.distributed.destroy_process_group(group)


def set_layout(tp: int, ep: int) -> None:
    """(Re)initialize Megatron's parallel state of the running processes for TP=tp, EP=ep."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    _destroy_subgroups()
    # Megatron's groups are gloo here already: its extra gloo copies would only add threads.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)


def gpt_config(tp: int, ep: int, **overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, moe_token_dispatcher_type="allgather",
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
    )  # fmt: skip
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(tp: int, ep: int, seed: Optional[int] = 0, **overrides):
    """The 2-layer, 4-expert top-2 GPT (SequentialMLP experts) at the current layout, in eval mode,
    with weights that depend on ``seed`` and not on the layout (None: Megatron's own init)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    model = GPTModel(config=gpt_config(tp, ep, **overrides), transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ).eval()
    if seed is not None:
        init_global_weights(model, seed)
    return model


def global_value(key: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full (global) tensor of checkpoint key ``key``: a function of the key and seed only."""
    import zlib

    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    x = torch.randn(shape, generator=g)
    if "norm" in key and key.endswith("weight"):
        return 1.0 + 0.1 * x
    if "norm" in key or key.endswith("bias"):
        return 0.05 * x
    if "embedding" in key:
        return 0.5 * x
    return x / shape[-1] ** 0.5


def local_slice(sh) -> tuple[slice, ...]:
    """The slices of the global tensor that ShardedTensor ``sh`` holds."""
    pre = sh.prepend_axis_num
    return tuple(slice(o, o + (1 if i < pre else sh.local_shape[i - pre])) for i, o in enumerate(sh.global_offset))


def sharded_tensors(model) -> list:
    """The ShardedTensors of ``model.sharded_state_dict()``, factories (the gate / up halves of a gated
    MLP's fc1) built into theirs; their ``data`` are the model's tensors or views of them."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out, todo = [], list(model.sharded_state_dict().values())
    while todo:
        x = todo.pop(0)
        if isinstance(x, ShardedTensorFactory):
            built = x.build()
            todo[:0] = list(built.values()) if isinstance(built, dict) else list(built) if isinstance(built, (list, tuple)) else [built]
        elif isinstance(x, ShardedTensor):
            out.append(x)
    return out


def init_global_weights(model, seed: int) -> None:
    """Give every parameter its slice of :func:`global_value`, so any layout holds the same model."""
    params = {id(p) for p in model.parameters()}
    with torch.no_grad():
        for sh in sharded_tensors(model):
            if id(sh.data) in params or (sh.data._base is not None and id(sh.data._base) in params):
                full = global_value(sh.key, tuple(sh.global_shape), seed)
                sh.data.copy_(full[local_slice(sh)].reshape(sh.data.shape))


def token_batches(n: int, seed: int, batch: int = 2, seq: int = SEQ) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def gpt_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [batch, seq, vocab] (gathered over TP), on every rank."""
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    with torch.no_grad():
        return model(tokens, positions, attention_mask=mask, runtime_gather_output=True).detach().clone()


def forward_loop(batches: list[torch.Tensor]) -> Callable:
    def loop(model) -> None:
        for tokens in batches:
            b, s = tokens.shape
            positions = torch.arange(s).unsqueeze(0).expand(b, s)
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
            model(tokens, positions, attention_mask=mask)  # (quantlib's progress hook replaces the output)

    return loop


def amax_pieces(model, suffix: str = "._amax") -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    """(checkpoint key, global shape, slices, local value) of every amax (every tensor whose key ends with
    ``suffix``) in ``model.sharded_state_dict()``."""
    out = []
    for sh in sharded_tensors(model):
        if sh.key.endswith(suffix):
            out.append((sh.key, tuple(sh.global_shape), local_slice(sh), sh.data.detach().clone().reshape(sh.local_shape)))
    return out


def assemble(pieces_by_rank: list[list]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Global amax tensors from every rank's pieces, and the places where two ranks disagree about one
    (a replica that is not synced) or where nobody holds a part."""
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    problems = []
    for rank, pieces in enumerate(pieces_by_rank):
        for key, shape, slices, value in pieces:
            if key not in full:
                full[key] = torch.full(shape, float("nan"))
                seen[key] = torch.zeros(shape, dtype=torch.bool)
            if tuple(full[key].shape) != shape:
                problems.append(f"{key}: global shape {shape} on rank {rank}, {tuple(full[key].shape)} elsewhere")
                continue
            region = full[key][slices]
            value = value.reshape(region.shape)
            held = seen[key][slices]
            if bool(held.any()) and not torch.equal(region[held], value[held]):
                problems.append(
                    f"{key}{[(s.start, s.stop) for s in slices]}: rank {rank} holds {value.flatten()[:4].tolist()}, "
                    f"another rank {region.flatten()[:4].tolist()}"
                )
            full[key][slices] = value
            seen[key][slices] = True
    problems += [f"{k}: no rank holds {int((~s).sum())} of its values" for k, s in seen.items() if not bool(s.all())]
    return full, problems
