"""Serialized configs carry a version (QuantizeConfig.to_dict's "version"), read through named migrations
like the checkpoint schema's: an unversioned dict reads as version 1, a newer one is refused by name."""

from __future__ import annotations

import copy

import pytest

import quantlib as ql
import quantlib.config as qconfig
from quantlib.config import CONFIG_VERSION, ConfigError, QuantizeConfig


def test_to_dict_carries_the_version_and_reads_back():
    cfg = QuantizeConfig.from_any(ql.NVFP4_DEFAULT_CFG)
    d = cfg.to_dict()
    assert d["version"] == CONFIG_VERSION == 1
    assert QuantizeConfig.from_any(d) == cfg


def test_an_unversioned_config_reads_as_version_1():
    plain = copy.deepcopy(ql.FP8_DEFAULT_CFG)
    assert "version" not in plain
    assert QuantizeConfig.from_any(plain) == QuantizeConfig.from_any(dict(plain, version=1))


@pytest.mark.parametrize("version", [2, 99])
def test_a_future_version_is_refused_by_name(version):
    with pytest.raises(ConfigError, match=rf"version={version}: the config was written by a newer quantlib .* up to 1"):
        QuantizeConfig.from_any(dict(ql.INT8_DEFAULT_CFG, version=version))


@pytest.mark.parametrize("version", [0, "1", True, 1.0])
def test_a_malformed_version_is_refused_by_name(version):
    with pytest.raises(ConfigError, match=r"version=.*: a config version is an int >= 1"):
        QuantizeConfig.from_any(dict(ql.INT8_DEFAULT_CFG, version=version))


def test_migrations_run_in_order(monkeypatch):
    """The chain itself, as a next version would use it: version 1 dicts go through migrate v1 -> v2."""

    def v1_to_v2(cfg: dict) -> dict:
        return dict(cfg, expert_input_policy="skip")  # a stand-in change of form

    monkeypatch.setattr(qconfig, "CONFIG_VERSION", 2)
    monkeypatch.setitem(qconfig.CONFIG_MIGRATIONS, 1, v1_to_v2)
    assert QuantizeConfig.from_any(dict(ql.INT8_DEFAULT_CFG)).expert_input_policy == "skip"
    assert QuantizeConfig.from_any(dict(ql.INT8_DEFAULT_CFG, version=2)).expert_input_policy == "max_of_peers"


def test_a_checkpoint_keeps_the_versioned_config(make_model, make_data, make_loop, tmp_path):
    model = ql.quantize(make_model("mlp"), dict(ql.INT8_DEFAULT_CFG, expert_input_policy="skip"), make_loop(make_data("mlp")))
    state = ql.checkpoint.quantizer_state(model)
    assert state["config"]["version"] == CONFIG_VERSION and state["config"]["expert_input_policy"] == "skip"
    state["config"]["version"] = CONFIG_VERSION + 1
    with pytest.raises(ql.checkpoint.CheckpointError, match=r"invalid config in the checkpoint: version=2"):
        ql.checkpoint.restore_state(make_model("mlp"), state)
