"""bus.json_file: checkpoint metadata and partition manifests read with a bounded size and depth, each
refusal a clear error of the loader's own type naming the file (issue 44: a router.json of 100000 `[`
killed `ddm-fleet coordinator` with a RecursionError traceback)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from bus.json_file import MAX_JSON_DEPTH, read_json_file
from coordinator.startup import router_spec
from dataset.partition import PartitionError, load_manifest
from models.autoencoder import AutoencoderError, load_autoencoder_meta
from models.checkpoint import CheckpointError, load_meta
from models.fleet_guidance import GuidanceDefaultError, fleet_default_guidance
from models.router import RouterError, load_router_meta
from models.spec import SpecError


class _Refused(Exception):
    pass


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_a_file_of_100000_brackets_is_refused_with_a_clear_error(tmp_path):
    path = tmp_path / "router.json"
    path.write_text("[" * 100_000)
    with pytest.raises(_Refused, match=rf"^{re.escape(str(path))}: JSON nested deeper than {MAX_JSON_DEPTH} levels$"):
        read_json_file(path, error=_Refused)


def test_depth_size_and_syntax_bounds(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"a": json.loads(_nested(MAX_JSON_DEPTH - 1))}))  # exactly the limit
    assert read_json_file(path, error=_Refused)["a"] == json.loads(_nested(MAX_JSON_DEPTH - 1))
    path.write_text(json.dumps({"a": json.loads(_nested(MAX_JSON_DEPTH))}))  # one more: under Python's own limit
    with pytest.raises(_Refused, match="nested deeper than"):
        read_json_file(path, error=_Refused)
    path.write_text('{"a": [1, 2, 3]}' + " " * 100)
    with pytest.raises(_Refused, match=rf"^{re.escape(str(path))}: larger than 64 bytes$"):
        read_json_file(path, error=_Refused, max_bytes=64)
    assert read_json_file(path, max_bytes=200) == {"a": [1, 2, 3]}
    for bad in (b"{not json", b"\xff\xfe\x00garbage"):
        path.write_bytes(bad)
        with pytest.raises(_Refused, match="is not valid JSON"):
            read_json_file(path, error=_Refused)
    with pytest.raises(FileNotFoundError):
        read_json_file(tmp_path / "nope.json")


@pytest.mark.parametrize(
    ("name", "load", "error"),
    [
        ("expert0", lambda p: load_meta(p.with_suffix(".safetensors")), CheckpointError),
        ("router", lambda p: load_router_meta(p.with_suffix(".safetensors")), RouterError),
        ("autoencoder", lambda p: load_autoencoder_meta(p.with_suffix(".safetensors")), AutoencoderError),
        ("router", fleet_default_guidance, GuidanceDefaultError),
        ("router", lambda p: router_spec(p.with_suffix(".safetensors")), SpecError),
        ("partition", load_manifest, PartitionError),
    ],
    ids=["expert", "router", "autoencoder", "router-guidance", "router-spec", "partition"],
)
def test_every_metadata_loader_refuses_a_deep_file_with_its_own_error(tmp_path, name, load, error):
    path = tmp_path / f"{name}.json"
    path.write_text("[" * 100_000)
    path.with_suffix(".safetensors").write_bytes(np.zeros(1).tobytes())
    with pytest.raises(error, match=re.escape(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels")):
        load(path)
