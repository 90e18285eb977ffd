"""A fleet's default guidance scale in its router JSON (`models.fleet_guidance`): read, written, refused
when it is no scale a job could ask for; `ddm-fleet coordinator --default-guidance` is checked the same way."""

from __future__ import annotations

import json
import math

import pytest

from coordinator.config import CoordinatorConfig
from models.fleet_guidance import (
    GuidanceDefaultError,
    default_beside,
    default_from_meta,
    fleet_default_guidance,
    set_default_guidance,
)


def test_no_entry_or_no_file_is_off(tmp_path):
    assert default_from_meta({"format": "ddm-fleet-router/1"}) == 1.0
    assert fleet_default_guidance(tmp_path / "router.safetensors") == 1.0  # no JSON at all
    assert default_beside(tmp_path / "expert0.safetensors") == 1.0


def test_written_then_read_by_every_path(tmp_path):
    (tmp_path / "router.json").write_text(json.dumps({"format": "ddm-fleet-router/1", "spec": {"x": 1}}))
    set_default_guidance(tmp_path / "router.safetensors", 2.5, chosen_by="sweep")
    meta = json.loads((tmp_path / "router.json").read_text())
    assert meta["guidance"] == {"default_scale": 2.5, "chosen_by": "sweep"} and meta["spec"] == {"x": 1}
    assert fleet_default_guidance(tmp_path / "router.safetensors") == 2.5
    assert fleet_default_guidance(tmp_path / "router.json") == 2.5
    assert default_beside(tmp_path / "expert1.safetensors") == 2.5


@pytest.mark.parametrize("bad", [-1, 20.5, math.inf, "2", True, None])
def test_a_bad_default_is_refused_saying_where(tmp_path, bad):
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"guidance": {"default_scale": bad}}))
    with pytest.raises(GuidanceDefaultError, match=r"router\.json: guidance\.default_scale"):
        fleet_default_guidance(path)
    path.write_text("{}")
    if isinstance(bad, (int, float)) and not isinstance(bad, bool):
        with pytest.raises(GuidanceDefaultError):
            set_default_guidance(path, bad)


def test_the_coordinators_flag(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    CoordinatorConfig.add_arguments(parser)
    cfg = CoordinatorConfig.from_args(parser.parse_args(["--default-guidance", "2"]))
    assert cfg.default_guidance == 2.0 and cfg.to_argv(["default_guidance"]) == ["--default-guidance", "2.0"]
    assert CoordinatorConfig.from_args(parser.parse_args([])).default_guidance is None
    for bad in (-0.5, 21.0):
        with pytest.raises(ValueError, match="--default-guidance"):
            CoordinatorConfig(default_guidance=bad)
