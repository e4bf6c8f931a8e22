"""The launch recipes in ``examples/launch`` (Slurm and Kubernetes) stay in step with the CLI.

Fast and offline: every ``rallypoint ...`` command in the recipes is parsed by rallypoint's
own argparse parser (``run`` commands also by ``config_from_args``, which checks the script
exists), the sbatch files pass ``bash -n``, and the Kubernetes manifests are read by a tiny
parser for the subset of YAML they use (block mappings and lists, scalars, JSON-style flow
lists, comments on their own lines), so PyYAML is not needed. kubectl/yq are not used.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rallypoint.cli import _build_parser
from rallypoint.supervisor.args import config_from_args

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "examples" / "launch"
SBATCH = sorted((LAUNCH / "slurm").glob("*.sbatch"))
MANIFESTS = sorted((LAUNCH / "kubernetes").glob("*.yaml"))

# Sample values for the variables the recipes put in commands (a variable with a
# ${VAR:-default} uses its default when it is not listed here).
SAMPLE_ENV = {
    "SLURM_ARRAY_TASK_ID": "3",
    "REPLICA_GROUP_ID": "3",
    "LIGHTHOUSE": "http://lh-node:29510",
    "RALLYPOINT_DIR": "/shared/rallypoint",
}


# --- a tiny reader for the YAML subset of the manifests ---------------------------------


class YamlSubsetError(ValueError):
    pass


def _lines(text: str) -> list[tuple[int, int, str]]:
    """(line number, indent, text) of the lines that carry content."""
    out = []
    for no, raw in enumerate(text.splitlines(), 1):
        if "\t" in raw:
            raise YamlSubsetError(f"line {no}: tab character")
        if raw != raw.rstrip():
            raise YamlSubsetError(f"line {no}: trailing whitespace")
        body = raw.lstrip(" ")
        if not body or body.startswith("#"):
            continue
        if " #" in body:
            raise YamlSubsetError(f"line {no}: keep comments on their own lines")
        indent = len(raw) - len(body)
        if indent % 2:
            raise YamlSubsetError(f"line {no}: indentation {indent} is not a multiple of 2")
        out.append((no, indent, body))
    return out


def _scalar(text: str, no: int) -> Any:
    text = text.strip()
    if text.startswith(("[", "{", '"')):
        try:
            return json.loads(text)  # flow lists are kept JSON (double-quoted strings)
        except json.JSONDecodeError as e:
            raise YamlSubsetError(f"line {no}: {text!r} is not a JSON-style flow value: {e}") from None
    if text.startswith(("|", ">", "'", "&", "*", "!")):
        raise YamlSubsetError(f"line {no}: {text[:1]!r} is outside the YAML subset the manifests use")
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if text in ("true", "false"):
        return text == "true"
    return text


_KEY = re.compile(r"([A-Za-z0-9_.\-/]+):(?: (.*))?$")


def _block(lines: list[tuple[int, int, str]], i: int, indent: int) -> tuple[Any, int]:
    no, ind, text = lines[i]
    if ind != indent:
        raise YamlSubsetError(f"line {no}: expected indentation {indent}, got {ind}")
    if text == "-" or text.startswith("- "):
        items = []
        while i < len(lines) and lines[i][1] == indent and (lines[i][2] == "-" or lines[i][2].startswith("- ")):
            no, _, text = lines[i]
            rest = text[2:]
            if not rest:
                if i + 1 >= len(lines) or lines[i + 1][1] <= indent:
                    raise YamlSubsetError(f"line {no}: empty list item")
                value, i = _block(lines, i + 1, lines[i + 1][1])
            elif _KEY.match(rest):  # a mapping that starts on the dash line
                value, i = _block([*lines[:i], (no, indent + 2, rest), *lines[i + 1:]], i, indent + 2)
            else:
                value, i = _scalar(rest, no), i + 1
            items.append(value)
        return items, _check_dedent(lines, i, indent, items)
    mapping: dict[str, Any] = {}
    while i < len(lines) and lines[i][1] == indent:
        no, _, text = lines[i]
        m = _KEY.match(text)
        if not m:
            raise YamlSubsetError(f"line {no}: expected 'key: value', got {text!r}")
        key, rest = m.group(1), m.group(2)
        if key in mapping:
            raise YamlSubsetError(f"line {no}: duplicate key {key!r}")
        if rest is None or not rest.strip():
            if i + 1 >= len(lines) or lines[i + 1][1] <= indent:
                raise YamlSubsetError(f"line {no}: {key!r} has no value")
            mapping[key], i = _block(lines, i + 1, lines[i + 1][1])
        else:
            mapping[key], i = _scalar(rest, no), i + 1
    return mapping, _check_dedent(lines, i, indent, mapping)


def _check_dedent(lines: list[tuple[int, int, str]], i: int, indent: int, _value: Any) -> int:
    if i < len(lines) and lines[i][1] > indent:
        raise YamlSubsetError(f"line {lines[i][0]}: unexpected indentation")
    return i


def load_documents(text: str) -> list[dict[str, Any]]:
    docs = []
    for part in re.split(r"^---$", text, flags=re.MULTILINE):
        lines = _lines(part)
        if not lines:
            continue
        doc, i = _block(lines, 0, 0)
        if i != len(lines) or not isinstance(doc, dict):
            raise YamlSubsetError(f"line {lines[min(i, len(lines) - 1)][0]}: not one top-level mapping")
        docs.append(doc)
    return docs


def test_the_yaml_subset_reader_refuses_what_it_does_not_understand() -> None:
    assert load_documents('a: 1\nb:\n  - x: "y"\n    z: [\"p\", \"q\"]\n  - 2\n---\nc: d\n') == [
        {"a": 1, "b": [{"x": "y", "z": ["p", "q"]}, 2]}, {"c": "d"}]
    for bad in ("a:\n\tb: 1\n", "a:\n   b: 1\n", "a: 1\n  b: 2\n", "a: 1\na: 2\n", "a: [x, y]\n",
                "a: |\n  text\n", "a: 1  # note\n", "a:\n", "a:\n  - x\n  b: 1\n"):
        with pytest.raises(YamlSubsetError):
            load_documents(bad)


# --- extracting the rallypoint commands ----------------------------------------------------


def _expand(word: str, env: dict[str, str]) -> str:
    """Shell (${VAR}, ${VAR:-default}, $VAR) and Kubernetes ($(VAR)) references."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3) or m.group(4)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return m.group(2)
        raise AssertionError(f"no sample value for ${name} in {word!r}; add it to SAMPLE_ENV")

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$\((\w+)\)|\$(\w+)", sub, word)


def sbatch_commands(path: Path) -> list[list[str]]:
    logical = re.sub(r"\\\n", " ", path.read_text())
    commands = []
    for line in logical.splitlines():
        words = shlex.split(line, comments=True)
        while words and words[0] in ("exec", "srun"):
            words = words[1:]
        if words[:1] == ["rallypoint"]:
            commands.append(words)
    return commands


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {})
    pod = spec.get("template", {}).get("spec", {}) if "template" in spec else spec
    return list(pod.get("containers", []))


def manifest_commands(path: Path) -> list[tuple[list[str], dict[str, Any], dict[str, Any]]]:
    """(command + args, container, document) of every container that runs rallypoint."""
    out = []
    for doc in load_documents(path.read_text()):
        for c in _containers(doc):
            argv = list(c.get("command", [])) + list(c.get("args", []))
            assert all(isinstance(w, str) for w in argv), f"{path.name}: command/args must be lists of strings"
            if argv[:1] == ["rallypoint"]:
                out.append((argv, c, doc))
    return out


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def _check_parses(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    argv = [_expand(w, env) for w in argv]
    assert argv[0] == "rallypoint"
    args = _build_parser().parse_args(argv[1:])  # SystemExit (a pytest failure) on a bad flag
    if args.command == "run":
        monkeypatch.chdir(REPO)  # the recipes run from the repository checkout
        config = config_from_args(args)
        assert config.target == "examples/train_ddp.py" and config.nproc >= 1
        assert config.group_id == env.get("REPLICA_GROUP_ID", env.get("SLURM_ARRAY_TASK_ID"))
    return args


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# --- the recipes --------------------------------------------------------------------------


def test_the_recipes_are_there() -> None:
    assert [p.name for p in SBATCH] == ["lighthouse.sbatch", "replica_groups.sbatch"]
    assert [p.name for p in MANIFESTS] == ["lighthouse.yaml", "replica-group.yaml"]
    assert (LAUNCH / "README.md").is_file()
    assert "examples/launch" in (REPO / "README.md").read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_is_valid_bash(path: Path) -> None:
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    text = path.read_text()
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --nodes=1" in text
    assert "set -euo pipefail" in text


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_commands_parse_with_the_cli(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = sbatch_commands(path)
    assert len(commands) == 1, commands
    args = _check_parses(commands[0], SAMPLE_ENV, monkeypatch)
    text = path.read_text()
    # The token comes from a file, checked to be private, and never from the command line.
    assert "--token" not in commands[0] and "RALLYPOINT_TOKEN=$(cat \"$TOKEN_FILE\")" in text
    assert "stat -c %a" in text
    if args.command == "lighthouse":
        assert args.state.startswith(SAMPLE_ENV["RALLYPOINT_DIR"])  # on shared storage
        assert (_port(args.bind), _port(args.http_bind)) == (29510, 29511)
        assert ':29510" > "$RALLYPOINT_DIR/lighthouse.addr"' in text
    else:
        assert args.command == "run" and args.replica_group_id == SAMPLE_ENV["SLURM_ARRAY_TASK_ID"]
        assert args.lighthouse == SAMPLE_ENV["LIGHTHOUSE"]
        assert re.search(r"^#SBATCH --array=", text, re.MULTILINE)
        assert "$RALLYPOINT_DIR/lighthouse.addr" in text


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_are_well_formed(path: Path) -> None:
    docs = load_documents(path.read_text())
    assert docs
    for doc in docs:
        assert isinstance(doc.get("apiVersion"), str) and isinstance(doc.get("kind"), str), doc
        assert isinstance(doc.get("metadata", {}).get("name"), str), doc
    assert len(manifest_commands(path)) == 1


def _by_kind(path: Path) -> dict[str, dict[str, Any]]:
    docs = load_documents(path.read_text())
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), "one document per kind"
    return kinds


def test_lighthouse_manifest_matches_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    path = LAUNCH / "kubernetes" / "lighthouse.yaml"
    kinds = _by_kind(path)
    service, deployment = kinds["Service"], kinds["Deployment"]
    ((argv, container, doc),) = manifest_commands(path)
    assert doc == deployment and deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    args = _check_parses(argv, _container_env(container), monkeypatch)
    assert args.command == "lighthouse" and "--token" not in argv
    grpc_port, http_port = _port(args.bind), _port(args.http_bind)

    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert (ports["grpc"]["port"], ports["grpc"]["targetPort"]) == (grpc_port, grpc_port)
    assert (ports["http"]["port"], ports["http"]["targetPort"]) == (http_port, http_port)
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": grpc_port, "http": http_port}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()

    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": http_port}

    (token,) = [e for e in container["env"] if e["name"] == "RALLYPOINT_TOKEN"]
    assert "secretKeyRef" in token["valueFrom"]
    # --state lives on the mounted volume, and that volume is declared.
    (mount,) = container["volumeMounts"]
    assert args.state.startswith(mount["mountPath"] + "/")
    (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
    assert volume["name"] == mount["name"]
    claim = volume.get("persistentVolumeClaim", {}).get("claimName")
    assert claim is None or kinds["PersistentVolumeClaim"]["metadata"]["name"] == claim


def test_replica_group_manifest_matches_the_cli_and_the_lighthouse(monkeypatch: pytest.MonkeyPatch) -> None:
    lh = _by_kind(LAUNCH / "kubernetes" / "lighthouse.yaml")["Service"]
    path = LAUNCH / "kubernetes" / "replica-group.yaml"
    ((argv, container, doc),) = manifest_commands(path)
    env = _container_env(container)
    args = _check_parses(argv, env, monkeypatch)
    assert args.command == "run" and args.replica_group_id == env["REPLICA_GROUP_ID"]
    assert doc["metadata"]["name"] == f"replica-group-{env['REPLICA_GROUP_ID']}"

    # The lighthouse address names the Service and its gRPC port.
    m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", env["RALLYPOINT_LIGHTHOUSE"])
    assert m, env["RALLYPOINT_LIGHTHOUSE"]
    assert m.group(1) == lh["metadata"]["name"]
    assert int(m.group(2)) == {p["name"]: p["port"] for p in lh["spec"]["ports"]}["grpc"]

    pod = doc["spec"]["template"]["spec"]
    # rallypoint run restarts the group itself: the kubelet must not restart it as well.
    assert doc["kind"] == "Job" and pod["restartPolicy"] == "Never"
    (token,) = [e for e in container["env"] if e["name"] == "RALLYPOINT_TOKEN"]
    assert "secretKeyRef" in token["valueFrom"] and "--token" not in argv
    assert container["resources"]["limits"]["nvidia.com/gpu"] == args.nproc_per_node
    # Peers reach the group under the name it advertises.
    headless = _by_kind(path)["Service"]
    assert headless["spec"]["clusterIP"] == "None" and pod["subdomain"] == headless["metadata"]["name"]
    assert pod["setHostnameAsFQDN"] is True and pod["hostname"] == doc["metadata"]["name"]
    assert headless["spec"]["selector"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
