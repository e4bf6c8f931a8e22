"""The public surface of ``rallypoint``: what ``dir(rallypoint)`` lists is the documented
list below (a name added or removed must change this test, the changelog and the docs),
each name imports, and each has a docstring of its own, as do its public methods."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest

import rallypoint

PUBLIC = [
    "DiLoCo",
    "DistributedDataParallel",
    "DistributedSampler",
    "DurableCheckpoint",
    "HTTPTransport",
    "LighthouseClient",
    "LighthouseServer",
    "LivenessStream",
    "LocalSGD",
    "Manager",
    "Optimizer",
    "OptimizerWrapper",
    "PGTransport",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "WorldSizeMode",
    "__version__",
    "fully_shard_replicated",
]
NAMES = [n for n in PUBLIC if n != "__version__"]


def test_dir_lists_exactly_the_documented_names() -> None:
    assert dir(rallypoint) == PUBLIC
    assert sorted(rallypoint.__all__) == PUBLIC


def test_dir_lists_them_before_anything_is_loaded() -> None:
    """In a fresh interpreter, where the lazy names are not loaded yet (and torch is not imported)."""
    code = "import rallypoint, sys; print(','.join(dir(rallypoint))); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    names, torch_loaded = out.stdout.split()
    assert names.split(",") == PUBLIC
    assert torch_loaded == "False"


def test_version_is_a_version() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", rallypoint.__version__)


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        rallypoint.Nope  # noqa: B018


def _own_doc(obj: object) -> str | None:
    """The object's own docstring (a class's, not one inherited from its base)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return doc.strip() if isinstance(doc, str) and doc.strip() else None


@pytest.mark.parametrize("name", NAMES)
def test_name_imports_and_has_a_docstring(name: str) -> None:
    obj = getattr(rallypoint, name)
    assert getattr(obj, "__module__", "").startswith("rallypoint."), obj
    assert _own_doc(obj), f"rallypoint.{name} has no docstring"


def _public_methods(cls: type) -> list[tuple[str, object]]:
    """Public methods and properties the class itself defines (not torch's it inherits)."""
    out = []
    for key, value in vars(cls).items():
        if key.startswith("_"):
            continue
        fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if inspect.isfunction(fn):
            out.append((key, fn))
    return out


@pytest.mark.parametrize("name", [n for n in NAMES if inspect.isclass(getattr(rallypoint, n))])
def test_public_methods_have_docstrings(name: str) -> None:
    cls = getattr(rallypoint, name)
    missing = [key for key, fn in _public_methods(cls) if not _own_doc(fn)]
    assert not missing, f"rallypoint.{name}: public methods without a docstring: {missing}"


def test_every_manager_argument_is_documented() -> None:
    """Each constructor argument of Manager has its line in the class docstring's Args."""
    doc = _own_doc(rallypoint.Manager) or ""
    args = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    params = [p for p in inspect.signature(rallypoint.Manager.__init__).parameters if p != "self"]
    missing = [p for p in params if not re.search(rf"^\s+{p}: \S", args, re.M)]
    assert not missing, f"Manager arguments without a line in its Args: {missing}"
