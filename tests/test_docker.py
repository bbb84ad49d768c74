"""The Docker deployment (docker/), checked without Docker: the development machines and CI have
no Docker engine. What needs one (building the images, running the containers) is listed as
untested in docker/README.md."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = ["Dockerfile.api", "Dockerfile.trainer"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What `docker compose` reads from the shell in these tests; every other variable takes its default.
SHELL_ENV = {"TUNER_API_TOKEN": "test-token"}


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default},
    ${VAR:?error}, ${VAR?error}."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("name") or m.group("bare"), m.group("op"), m.group("arg")
        is_set = name in env and (env[name] != "" or not (op or "").startswith(":"))
        if op in (":-", "-"):
            return env[name] if is_set else arg
        if op in (":?", "?"):
            if not is_set:
                raise ValueError(f"{name}: {arg}")
            return env[name]
        return env.get(name, "")

    pattern = r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>\w+)"
    return re.sub(pattern, sub, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # ["KEY=value", ...]
        env = dict(item.partition("=")[::2] for item in env)
    return {k: _interpolate(str(v), SHELL_ENV) for k, v in env.items()}


def _dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; comments dropped, continuation lines joined."""
    lines = [line for line in (DOCKER / name).read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    instructions = []
    for line in joined.splitlines():
        keyword, _, args = line.strip().partition(" ")
        if keyword:
            instructions.append((keyword.upper(), args.strip()))
    return instructions


def _words(args: str) -> list[str]:
    """Exec (JSON) or shell form."""
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def _copy(args: str) -> tuple[list[str], str]:
    """COPY's sources and destination; its leading flags (--chmod=...) dropped."""
    words = _words(args)
    while words[0].startswith("--"):
        words.pop(0)
    return words[:-1], words[-1]


def _only(instructions: list[tuple[str, str]], keyword: str) -> str:
    found = [args for kw, args in instructions if kw == keyword]
    assert len(found) == 1, f"{keyword}: {found}"
    return found[0]


def _base_image(name: str) -> str:
    instructions = _dockerfile(name)
    defaults = dict(a.partition("=")[::2] for kw, a in instructions if kw == "ARG" and "=" in a)
    return _interpolate(_only(instructions, "FROM"), defaults)


def test_compose_has_the_services(compose: dict) -> None:
    assert {"db", "api", "worker"} <= set(compose["services"])
    services = compose["services"]
    assert services["db"]["image"].startswith("postgres:16")
    assert services["api"]["build"]["dockerfile"] == "docker/Dockerfile.api"
    assert services["worker"]["build"]["dockerfile"] == "docker/Dockerfile.trainer"
    for name in ("api", "worker"):
        context = (DOCKER / services[name]["build"]["context"]).resolve()
        assert context == ROOT, f"{name}: the Dockerfiles copy paths relative to the repository root"
        assert services[name]["depends_on"]["db"]["condition"] == "service_healthy"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert [d["driver"] for d in devices] == ["nvidia"]


def test_tuner_variables_are_ones_the_code_reads(compose: dict) -> None:
    from tuner.settings import Settings, SlurmSettings

    # What tuner/settings.py reads (pydantic-settings: TUNER_ + the field name), and any name the
    # code spells out (the environment of jobs and allocations).
    read = {f"TUNER_{f.upper()}" for f in Settings.model_fields} | {
        f"TUNER_SLURM_{f.upper()}" for f in SlurmSettings.model_fields
    }
    read |= {
        name
        for package in ("tuner", "api")
        for path in (ROOT / package).rglob("*.py")
        for name in re.findall(r"\bTUNER_[A-Z0-9_]+\b", path.read_text())
    }
    used = {k for s in compose["services"].values() for k in _environment(s) if k.startswith("TUNER_")}
    for name in DOCKERFILES:
        used |= {a.split("=")[0] for kw, a in _dockerfile(name) if kw == "ENV" and a.startswith("TUNER_")}
    assert used, "compose sets no TUNER_ variable"
    assert used <= read, f"not read by tuner/ or api/: {sorted(used - read)}"


def test_api_requires_a_token(compose: dict) -> None:
    with pytest.raises(ValueError, match="TUNER_API_TOKEN"):
        _interpolate(compose["services"]["api"]["environment"]["TUNER_API_TOKEN"], {})


def test_database_url_points_at_the_db_service(compose: dict) -> None:
    services = compose["services"]
    db = _environment(services["db"])
    urls = {name: _environment(services[name])["TUNER_DATABASE_URL"] for name in ("api", "worker")}
    assert urls["api"] == urls["worker"]
    url = make_url(urls["api"])
    assert url.drivername == "postgresql+psycopg"
    assert url.host == "db"
    assert url.port == int(db.get("PGPORT", 5432))
    assert (url.username, url.password, url.database) == (
        db["POSTGRES_USER"],
        db["POSTGRES_PASSWORD"],
        db["POSTGRES_DB"],
    )
    assert "pg_isready" in " ".join(services["db"]["healthcheck"]["test"])


def test_api_port_agrees_everywhere(compose: dict) -> None:
    api = compose["services"]["api"]
    [mapping] = api["ports"]
    host_ip, _host_port, container_port = str(mapping).split(":")
    assert host_ip == "127.0.0.1", "the API is published on loopback only"
    instructions = _dockerfile("Dockerfile.api")
    command = api.get("command") or _words(_only(instructions, "CMD"))
    command = shlex.split(command) if isinstance(command, str) else command
    assert command[:2] == ["tuner", "serve"] and "--no-worker" in command
    assert command[command.index("--port") + 1] == container_port
    assert container_port in _only(instructions, "EXPOSE").split()
    healthchecks = [_only(instructions, "HEALTHCHECK"), " ".join(api["healthcheck"]["test"])]
    for check in healthchecks:
        assert re.findall(r"http://[\w.]+:(\d+)/healthz", check) == [container_port], check


def test_named_volumes_are_declared(compose: dict) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if not source.startswith((".", "/", "~")):
                assert source in declared, f"{name}: volume {source} not declared"
    assert {"pgdata", "runs"} <= declared
    worker = compose["services"]["worker"]
    assert f"runs:{_environment(worker)['TUNER_WORK_DIR']}" in worker["volumes"]


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates):
            ignored = not negated
    return ignored


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_what_exists(name: str) -> None:
    instructions = _dockerfile(name)
    ignore = DOCKER / f"{name}.dockerignore"
    patterns = [
        line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    sources = [src for kw, args in instructions if kw == "COPY" for src in _copy(args)[0]]
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"{name}: COPY {src}: no such path"
        files = [p for p in path.rglob("*.py") if "__pycache__" not in p.parts] if path.is_dir() else [path]
        for file in files:
            relative = file.relative_to(ROOT).as_posix()
            assert not _ignored(relative, patterns), f"{name}: {relative} is excluded by {ignore.name}"
    # What `pip install .` needs: pyproject, its readme and every package it finds.
    found = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in found if (ROOT / p.rstrip("*") / "__init__.py").exists()}
    copied = {src.strip("/") for src in sources}
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} | packages <= copied


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_runs_the_entrypoint_as_a_user(name: str) -> None:
    instructions = _dockerfile(name)
    workdir = Path(_only(instructions, "WORKDIR"))
    copied = set()
    for kw, args in instructions:
        if kw == "COPY":
            srcs, dest = _copy(args)
            copied |= {
                str(workdir / dest / Path(s).name) if dest.endswith("/") else str(workdir / dest)
                for s in srcs
            }
    assert json.loads(_only(instructions, "ENTRYPOINT")) == [str(workdir / "docker/entrypoint.sh")]
    assert str(workdir / "docker/entrypoint.sh") in copied
    assert _only(instructions, "USER") not in ("root", "0")
    # The API image: the api extra (no torch); the trainer image: worker + api over the base's CUDA torch.
    extra = "'.[worker,api]'" if name == "Dockerfile.trainer" else "'.[api]'"
    assert f"pip install {extra}" in " ".join(args for kw, args in instructions if kw == "RUN")
    expected = ["tuner", "worker"] if name == "Dockerfile.trainer" else ["tuner", "serve", "--no-worker"]
    assert _words(_only(instructions, "CMD"))[: len(expected)] == expected


def test_entrypoint_is_an_executable_bash_script() -> None:
    entrypoint = DOCKER / "entrypoint.sh"
    assert os.access(entrypoint, os.X_OK)
    subprocess.run(["bash", "-n", str(entrypoint)], check=True)
    text = entrypoint.read_text()
    assert "set -euo pipefail" in text and "tuner db upgrade" in text and 'exec "$@"' in text


def _extra(name: str) -> list[Requirement]:
    return [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][name]]


def test_the_api_extra_has_no_torch_and_pulls_none_in() -> None:
    """The API image installs .[api]: the core and the api extra must not bring torch, directly or
    through what they depend on (as far as the installed packages' metadata tells)."""
    roots = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]] + _extra("api")
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        req = stack.pop()
        assert canonicalize_name(req.name) not in (
            "torch",
            "optuna",
            "deephyper",
        ) and not req.name.startswith("nvidia-"), f"{req} is in the API's install"
        key = f"{canonicalize_name(req.name)}{sorted(req.extras)}"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = distribution(req.name).requires or []
        except PackageNotFoundError:
            continue
        for line in requires:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in {"", *req.extras}):
                stack.append(dep)


def test_base_images_are_pinned() -> None:
    [torch_pin] = [d for d in _extra("trainer") if canonicalize_name(d.name) == "torch"]
    torch_version = next(iter(torch_pin.specifier)).version
    repository, _, tag = _base_image("Dockerfile.trainer").partition(":")
    assert repository == "pytorch/pytorch"
    assert tag and tag != "latest"
    assert tag.startswith(f"{torch_version}-cuda") and tag.endswith("-runtime"), (
        f"pytorch/pytorch:{tag}: not a CUDA runtime image of pyproject's torch {torch_version}"
    )
    python = re.fullmatch(r"python:(\d+\.\d+)-slim", _base_image("Dockerfile.api"))
    assert python, _base_image("Dockerfile.api")
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(python.group(1))


def test_the_commands_the_images_run_exist() -> None:
    import subprocess

    tuner = str(Path(sys.executable).parent / "tuner")
    serve = subprocess.run(
        [tuner, "serve", "--help"], capture_output=True, text=True, env={"COLUMNS": "200", "PATH": ""}
    )
    assert serve.returncode == 0 and "--no-worker" in serve.stdout and "--port" in serve.stdout
    worker = subprocess.run([tuner, "worker", "--help"], capture_output=True, text=True)
    assert worker.returncode == 0 and "--exit-when-idle" in worker.stdout
