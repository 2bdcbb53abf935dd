"""quantlib's SequentialMLP (Megatron-Core, local spec) reads nothing back to the host in its calibrating
forward: the tokens each expert received are added up on the device, and only formatted for the debug
log where DEBUG is on (Megatron's own ``SequentialMLP.forward`` still reads ``tokens_per_expert``)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'quantlib[megatron]')")

import quantlib as ql  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402
from tests.test_plugins.host_reads import HostReads  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

OURS = "quantlib/plugins/megatron.py"


def _run(rank: int, world: int, debug: bool) -> dict:
    shims.set_layout(1, 1)
    logging.getLogger("quantlib").setLevel(logging.DEBUG if debug else logging.WARNING)
    data = shims.token_batches(2, 1)

    def loop(model) -> None:
        with HostReads() as reads:
            shims.forward_loop(data)(model)
        seen.extend(reads.seen)

    seen: list[str] = []
    model = ql.quantize(shims.build_gpt(1, 1, 0), ql.FP8_DEFAULT_CFG, loop)
    from quantlib.plugins.megatron import expert_token_counts

    counts = expert_token_counts(model)
    return {"ours": [s for s in seen if OURS in s], "all": seen, "tokens": sum(sum(c.values()) for c in counts.values())}


@pytest.mark.parametrize("debug", [False, True], ids=["debug-off", "debug-on"])
def test_calibrating_sequential_mlp_reads_back_only_for_the_debug_log(debug):
    (res,) = shims.run_distributed(_run, 1, debug)
    assert res["tokens"] > 0  # the counts were kept (on the device)
    if debug:
        assert res["ours"] and all("forward" in s for s in res["ours"]), res["all"]
    else:
        assert res["ours"] == [], res["ours"]
