"""The model spec: what every model of a fleet produces and takes, carried from checkpoint to viewer.

One JSON object, stored in every checkpoint's metadata (`"spec"`), advertised by every worker in its
service metadata, read by the coordinator at start (a fleet whose members disagree is refused) and
returned by `fleet.status`. Everything downstream (scheduler shapes, router input, generate, viewer,
eval, benches) reads shapes and class names from it instead of constants.

    {"sample_shape": [3, 32, 32],            # [C, H, W] of one sample on the wire
     "value_range": [-1.0, 1.0],             # the data's range (samples are clipped to it at the end)
     "space": "pixels",                      # or "latent": then "decoder" names the stage to pixels
     "decoder": null,
     "conditioning": {"kind": "class", "num_classes": 10, "class_names": ["0", ...], "null_label": true},
     "prediction": "velocity",               # in the project's time convention
     "time_convention": "t0_noise_t1_data",  # t = 0 noise, t = 1 data
     "arch": "unet"}                         # this model's network (may differ between experts)

A fleet's spec, as `fleet.status` reports it, names the network that routes (`arch`: "router" for a
trained router, coordinator.service.router_arch) and, when the request asks for it (`"image_spec": true`),
also the images a client gets: `image_shape` [C, H, W] and `image_value_range` [low, high] of `done.images`
and frame previews. In a pixel fleet they equal `sample_shape` / `value_range`; in a latent fleet they are
the decoder's (the autoencoder's image shape, pixels in [-1, 1]) while `sample_shape` / `value_range` stay
the latents'. A checkpoint's or a worker's spec never carries them (None: left out of the JSON).

Checkpoints written before the spec existed have the implied spec `legacy_spec()` (1x32x32 pixels in
[-1, 1], 10 classes named "0" to "9", velocity, UNet).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer, model_validator

#: The time convention every model of a fleet uses: x_t = (1 - t) noise + t data, v = data - noise.
TIME_CONVENTION = "t0_noise_t1_data"

#: Fields on which every member of a fleet must agree (the architecture may differ per expert, and
#: whether an expert has a null label is probed per expert).
FLEET_FIELDS = ("sample_shape", "value_range", "space", "decoder", "prediction", "time_convention")

#: Fields only a fleet's reported spec carries (`fleet.status` asked with "image_spec"), never a checkpoint's
#: or a worker's: left out of the serialised spec when None, so those stay as they were.
IMAGE_FIELDS = ("image_shape", "image_value_range")

#: Largest sample a spec may declare (elements of C x H x W): 4 x 256 x 256 latents or a 3 x 512 x 512
#: image; a step batch of such samples still has to fit MAX_PAYLOAD_BYTES in rows.
MAX_SAMPLE_ELEMENTS = 3 * 512 * 512
MAX_CLASSES = 100_000
MAX_CLASS_NAME_LEN = 64


def _as_tuple(value):
    return tuple(value) if isinstance(value, list) else value


def _as_float_tuple(value):
    if isinstance(value, (list, tuple)):
        return tuple(float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value)
    return value


class SpecError(ValueError):
    """A spec is malformed, or two specs that must agree do not."""


class Conditioning(BaseModel):
    """What a model is conditioned on: `class` labels 0..num_classes-1, or `none` (unconditional models;
    every row's label is -1). `null_label`: the model was trained with a null label, label -1 ("unknown");
    in a fleet's spec that is its router's, and whether each expert serves -1 is checked when a job needs it
    (docs/PROTOCOL.md, `fleet_status`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["class", "none"] = "class"
    num_classes: int = Field(default=10, ge=0, le=MAX_CLASSES)
    class_names: list[str] | None = None
    null_label: bool = False

    @model_validator(mode="after")
    def _check(self) -> Conditioning:
        if self.kind == "none":
            if self.num_classes != 0 or self.class_names:
                raise ValueError("conditioning kind 'none' takes no classes: num_classes 0, no class_names")
        elif self.num_classes < 1:
            raise ValueError("conditioning kind 'class' needs num_classes >= 1 (or use kind 'none')")
        if self.class_names is not None:
            if len(self.class_names) != self.num_classes:
                raise ValueError(f"class_names has {len(self.class_names)} names for {self.num_classes} classes")
            bad = [n for n in self.class_names if not n or len(n) > MAX_CLASS_NAME_LEN]
            if bad:
                raise ValueError(f"class names must be 1-{MAX_CLASS_NAME_LEN} characters, got {bad[0]!r}")
        return self

    def name_of(self, label: int) -> str:
        """The display name of `label` ("unknown" for -1)."""
        if label < 0:
            return "unknown"
        if self.class_names is not None:
            return self.class_names[label]
        return str(label)


class ModelSpec(BaseModel):
    """The spec of one model (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # msgpack and JSON carry these as arrays (lists), which the wire's strict validation refuses as tuples
    sample_shape: Annotated[tuple[int, int, int], BeforeValidator(_as_tuple)]
    value_range: Annotated[tuple[float, float], BeforeValidator(_as_float_tuple)] = (-1.0, 1.0)
    space: Literal["pixels", "latent"] = "pixels"
    decoder: str | None = None
    conditioning: Conditioning = Conditioning()
    prediction: Literal["velocity"] = "velocity"
    time_convention: Literal["t0_noise_t1_data"] = TIME_CONVENTION
    arch: str = Field(default="unet", min_length=1, max_length=64)
    #: the images a client gets (`done.images`, previews), in a fleet's reported spec only (module docstring)
    image_shape: Annotated[tuple[int, int, int] | None, BeforeValidator(_as_tuple)] = None
    image_value_range: Annotated[tuple[float, float] | None, BeforeValidator(_as_float_tuple)] = None

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        c, h, w = self.sample_shape
        if min(c, h, w) < 1:
            raise ValueError(f"sample_shape must be [C, H, W] with every size >= 1, got {list(self.sample_shape)}")
        if c * h * w > MAX_SAMPLE_ELEMENTS:
            raise ValueError(
                f"sample_shape {list(self.sample_shape)} has {c * h * w} elements; the limit is {MAX_SAMPLE_ELEMENTS}"
            )
        lo, hi = self.value_range
        if not lo < hi:
            raise ValueError(f"value_range must be [low, high] with low < high, got {list(self.value_range)}")
        if self.image_shape is not None:
            ic, ih, iw = self.image_shape
            if min(ic, ih, iw) < 1 or ic * ih * iw > MAX_SAMPLE_ELEMENTS:
                raise ValueError(
                    f"image_shape must be [C, H, W] with every size >= 1 and at most {MAX_SAMPLE_ELEMENTS} elements, "
                    f"got {list(self.image_shape)}"
                )
            if self.space == "pixels" and tuple(self.image_shape) != tuple(self.sample_shape):
                raise ValueError(
                    f"a pixel-space spec's image_shape is its sample_shape {list(self.sample_shape)}, "
                    f"got {list(self.image_shape)}"
                )
        if self.image_value_range is not None:
            ilo, ihi = self.image_value_range
            if not ilo < ihi:
                raise ValueError(
                    f"image_value_range must be [low, high] with low < high, got {list(self.image_value_range)}"
                )
            if self.space == "pixels" and tuple(self.image_value_range) != tuple(self.value_range):
                raise ValueError(
                    f"a pixel-space spec's image_value_range is its value_range {list(self.value_range)}, "
                    f"got {list(self.image_value_range)}"
                )
        if self.space == "latent" and not self.decoder:
            raise ValueError(
                'a latent-space spec names its decoder ("decoder": the autoencoder that maps latents to pixels)'
            )
        if self.space == "pixels" and self.decoder:
            raise ValueError("a pixel-space spec has no decoder")
        return self

    @model_serializer(mode="wrap")
    def _omit_unset_image_fields(self, handler):
        out = handler(self)
        if isinstance(out, dict):
            for name in IMAGE_FIELDS:
                if out.get(name) is None:
                    out.pop(name, None)
        return out

    # ------------------------------------------------------------------ helpers
    @property
    def num_classes(self) -> int:
        return self.conditioning.num_classes

    def to_json(self) -> dict:
        """The spec as a JSON-ready dict (the checkpoint's and the service metadata's form)."""
        return self.model_dump(mode="json")

    def with_images(self, image_shape=None, image_value_range=None) -> ModelSpec:
        """This spec naming the images a client gets (module docstring): a pixel spec's own sample shape
        and value range; a latent spec's `image_shape` / `image_value_range` as given (None: not known,
        left out). Any image fields this spec had are replaced."""
        if self.space == "pixels":
            image_shape, image_value_range = self.sample_shape, self.value_range
        update = {
            "image_shape": None if image_shape is None else tuple(int(v) for v in image_shape),
            "image_value_range": None if image_value_range is None else tuple(float(v) for v in image_value_range),
        }
        return ModelSpec.model_validate({**self.model_dump(mode="python"), **update})

    def without_images(self) -> ModelSpec:
        """This spec without the image fields (a checkpoint's and a worker's form)."""
        return self.model_copy(update={name: None for name in IMAGE_FIELDS})

    @classmethod
    def from_json(cls, data: dict, where: str = "spec") -> ModelSpec:
        """Parse a spec dict; SpecError says where and what is wrong."""
        from pydantic import ValidationError

        try:
            return cls.model_validate(data)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: {e['msg']}" for e in err.errors())
            raise SpecError(f"{where}: bad model spec: {problems}") from None

    def differences(self, other: ModelSpec) -> list[str]:
        """The fleet-level fields where `other` differs from this spec ("field: mine != theirs"), and
        the class conditioning (kind, count and names); empty when they can serve one fleet."""
        out = [
            f"{f}: {getattr(self, f)!r} != {getattr(other, f)!r}"
            for f in FLEET_FIELDS
            if getattr(self, f) != getattr(other, f)
        ]
        a, b = self.conditioning, other.conditioning
        if a.kind != b.kind or a.num_classes != b.num_classes:
            out.append(f"conditioning: {a.kind} with {a.num_classes} classes != {b.kind} with {b.num_classes}")
        elif a.class_names and b.class_names and a.class_names != b.class_names:
            out.append(f"class_names: {a.class_names} != {b.class_names}")
        return out


def legacy_spec(
    *, in_channels: int = 1, image_size: int = 32, num_classes: int = 10, null_label: bool = False, arch: str = "unet"
) -> ModelSpec:
    """The spec implied by a checkpoint made before specs existed (the MNIST fleet's: 1x32x32 pixels,
    10 classes named "0"-"9", velocity, UNet), or by the UNet config fields given."""
    names = [str(i) for i in range(num_classes)] if num_classes == 10 else None
    return ModelSpec(
        sample_shape=(in_channels, image_size, image_size),
        conditioning=Conditioning(kind="class", num_classes=num_classes, class_names=names, null_label=null_label),
        arch=arch,
    )


def fleet_spec(specs: dict[str, ModelSpec]) -> ModelSpec:
    """The one spec a fleet serves, from its members' specs ({member name: spec}, e.g. "router",
    "expert 0 (worker ab12)"). Raises SpecError naming each member that differs from the first one
    (the router when present), with what differs. Class names missing on some members are taken from
    the members that have them; the result's null_label is the first member's."""
    if not specs:
        raise SpecError("no model specs to compare")
    items = list(specs.items())
    ref_name, ref = items[0]
    problems = []
    for name, spec in items[1:]:
        diff = ref.differences(spec)
        if diff:
            problems.append(f"{name} differs from {ref_name}: " + "; ".join(diff))
    if problems:
        raise SpecError("the fleet's models disagree on their spec: " + " | ".join(problems))
    if ref.conditioning.class_names is None:
        named = next((s.conditioning.class_names for _, s in items if s.conditioning.class_names), None)
        if named is not None:
            ref = ref.model_copy(update={"conditioning": ref.conditioning.model_copy(update={"class_names": named})})
    return ref
