"""schemas.spec: the model spec's validation, comparison across a fleet, and its legacy default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.spec import spec_of, with_spec
from schemas.spec import Conditioning, ModelSpec, SpecError, fleet_spec, legacy_spec

ROOT = Path(__file__).resolve().parents[2]


def rgb(**kw) -> ModelSpec:
    base = dict(sample_shape=(3, 32, 32), conditioning=Conditioning(num_classes=4, class_names=list("abcd")))
    return ModelSpec(**{**base, **kw})


def test_round_trip_through_json():
    spec = rgb(arch="dit")
    again = ModelSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert again == spec and again.sample_shape == (3, 32, 32) and again.conditioning.class_names == list("abcd")


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"sample_shape": [0, 32, 32]}, "every size >= 1"),
        ({"sample_shape": [3, 32]}, "sample_shape"),
        ({"sample_shape": [3, 4096, 4096]}, "the limit is"),
        ({"sample_shape": [1, 8, 8], "value_range": [1, -1]}, "low < high"),
        ({"sample_shape": [4, 8, 8], "space": "latent"}, "names its decoder"),
        ({"sample_shape": [1, 8, 8], "decoder": "vae"}, "pixel-space spec has no decoder"),
        ({"sample_shape": [1, 8, 8], "prediction": "epsilon"}, "prediction"),
        ({"sample_shape": [1, 8, 8], "time_convention": "t0_data_t1_noise"}, "time_convention"),
        ({"sample_shape": [1, 8, 8], "conditioning": {"num_classes": 3, "class_names": ["a"]}}, "1 names for 3"),
        ({"sample_shape": [1, 8, 8], "conditioning": {"kind": "none", "num_classes": 3}}, "takes no classes"),
        ({"sample_shape": [1, 8, 8], "conditioning": {"kind": "class", "num_classes": 0}}, "num_classes >= 1"),
        ({"sample_shape": [1, 8, 8], "surprise": 1}, "surprise"),
    ],
)
def test_bad_specs_are_refused_with_the_reason(bad, needle):
    with pytest.raises(SpecError, match="expert 3") as err:
        ModelSpec.from_json(bad, where="expert 3")
    assert needle in str(err.value)


def test_unconditional_spec_names_unknown():
    spec = ModelSpec(sample_shape=(1, 8, 8), conditioning=Conditioning(kind="none", num_classes=0))
    assert spec.num_classes == 0 and spec.conditioning.name_of(-1) == "unknown"
    assert rgb().conditioning.name_of(2) == "c"
    assert legacy_spec().conditioning.name_of(7) == "7"


def test_fleet_spec_accepts_agreeing_members_of_different_architectures():
    got = fleet_spec({"router": rgb(arch="router-cnn"), "expert 0": rgb(arch="unet"), "expert 1": rgb(arch="dit")})
    assert got.sample_shape == (3, 32, 32)


def test_fleet_spec_names_the_member_that_differs():
    members = {"router": rgb(), "expert 0 (worker w1)": rgb(), "expert 1 (worker w2)": rgb(sample_shape=(1, 32, 32))}
    with pytest.raises(SpecError) as err:
        fleet_spec(members)
    msg = str(err.value)
    assert "expert 1 (worker w2) differs from router" in msg and "sample_shape" in msg and "expert 0" not in msg


def test_fleet_spec_refuses_a_different_class_count_or_names():
    with pytest.raises(SpecError, match="4 classes != class with 10"):
        fleet_spec({"router": rgb(), "expert 0": legacy_spec(in_channels=3)})
    other = rgb(conditioning=Conditioning(num_classes=4, class_names=list("wxyz")))
    with pytest.raises(SpecError, match="class_names"):
        fleet_spec({"router": rgb(), "expert 0": other})


def test_fleet_spec_fills_class_names_from_a_member_that_has_them():
    unnamed = rgb(conditioning=Conditioning(num_classes=4))
    assert fleet_spec({"router": unnamed, "expert 0": rgb()}).conditioning.class_names == list("abcd")


@pytest.mark.parametrize("name", ["monolith", "router"])
def test_shipped_checkpoints_without_a_spec_imply_the_mnist_one(name):
    meta = json.loads((ROOT / "checkpoints" / f"{name}.json").read_text())
    assert "spec" not in meta
    spec = spec_of(meta, where=name)
    assert spec.sample_shape == (1, 32, 32) and spec.num_classes == 10 and spec.space == "pixels"
    assert spec.conditioning.class_names == [str(i) for i in range(10)]


@pytest.mark.parametrize("name", ["expert0", "expert1"])
def test_the_default_experts_carry_the_mnist_spec_with_a_null_label(name):
    """Retrained with label dropout (checkpoints/README.md): the same MNIST spec as the router's implied one,
    plus the null label that classifier-free guidance and unconditional rows need."""
    spec = spec_of(json.loads((ROOT / "checkpoints" / f"{name}.json").read_text()), where=name)
    router = spec_of(json.loads((ROOT / "checkpoints" / "router.json").read_text()), where="router")
    assert spec.conditioning.null_label and not spec.differences(router)
    assert spec.sample_shape == (1, 32, 32) and spec.conditioning.class_names == [str(i) for i in range(10)]


def test_stored_spec_wins_and_must_match_the_config():
    meta = {"config": {"in_channels": 3, "image_size": 32, "num_classes": 4}}
    assert spec_of(with_spec(meta, rgb())).conditioning.class_names == list("abcd")
    with pytest.raises(SpecError, match="config in_channels 1 != spec channels 3"):
        spec_of(with_spec({"config": {"in_channels": 1}}, rgb()), where="x.json")
    with pytest.raises(SpecError, match="must be a JSON object"):
        spec_of({"spec": [1, 2]})


def test_image_fields_are_left_out_unless_set_and_a_pixel_spec_names_its_own_samples():
    """A checkpoint's and a worker's spec carry no image fields (their JSON is unchanged); a fleet's reported
    spec names its images: a pixel spec its samples, a latent spec its decoder's images."""
    spec = rgb()
    assert "image_shape" not in spec.to_json() and "image_value_range" not in spec.to_json()
    shown = spec.with_images()
    assert shown.image_shape == (3, 32, 32) and shown.image_value_range == (-1.0, 1.0)
    assert shown.to_json()["image_shape"] == [3, 32, 32] and shown.without_images() == spec
    assert ModelSpec.from_json(json.loads(json.dumps(shown.to_json()))) == shown
    with pytest.raises(SpecError, match="image_shape is its sample_shape"):
        ModelSpec.from_json({**spec.to_json(), "image_shape": [1, 32, 32]})
    with pytest.raises(SpecError, match="image_value_range is its value_range"):
        ModelSpec.from_json({**spec.to_json(), "image_value_range": [0, 1]})
    latent = rgb(sample_shape=(4, 8, 8), value_range=(-5, 5), space="latent", decoder="autoencoder@sha256:" + "a" * 64)
    seen = latent.with_images((3, 16, 16), (-1, 1))
    assert seen.sample_shape == (4, 8, 8) and seen.value_range == (-5.0, 5.0)
    assert seen.image_shape == (3, 16, 16) and seen.image_value_range == (-1.0, 1.0)
    assert latent.with_images().to_json() == latent.to_json()  # not known: left out
    with pytest.raises(SpecError, match="image_shape"):
        ModelSpec.from_json({**latent.to_json(), "image_shape": [3, 0, 16]})
