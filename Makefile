# `make test` and `make demo` work on a fresh machine: they create .venv, install
# torch 2.13.0 (the CPU wheel here) when torch is not importable, then the package
# with its test extras, then run.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.rallypoint-installed
DOCS_STAMP := $(VENV)/.rallypoint-docs-installed
PYTEST_ARGS ?=

.PHONY: test typecheck browser etcd demo demo-lighthouse proto bench install clean wheel-check docs \
	gpu-check gpu-wheels test-newest torchft-nightly-check torchtitan-check

# torchft-nightly (the 0.3 API) installs the same `torchft` package as torchft 0.2.0, so it is
# unpacked beside a venv, not into it (`pip install --no-deps --target VENV/torchft-nightly`):
# its native module (no torch dependency) serves the protocol interop tests in any venv, and
# `make torchft-nightly-check` runs its own integration tests from there.
TORCHFT_NIGHTLY := 2026.10.26
# The newest torch that installs here (users may be on newer: the code must not assume it).
TORCH_NEWEST := 2.14.1
VENV_NEWEST ?= .venv-newest
NPY     := $(VENV_NEWEST)/bin/python
NEWEST_STAMP := $(VENV_NEWEST)/.rallypoint-installed
NIGHTLY_MARK := torchft-nightly/torchft_nightly-$(TORCHFT_NIGHTLY).dist-info/METADATA

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip

$(STAMP): $(VPY) pyproject.toml
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

install: $(STAMP) $(VENV)/$(NIGHTLY_MARK)

# VENV/torchft-nightly/ for any venv (the wheel is built for that venv's python); a folder left
# by an older version is replaced whole.
%/$(NIGHTLY_MARK): %/bin/python
	rm -rf $*/torchft-nightly
	$*/bin/python -m pip install --quiet --no-deps --target $*/torchft-nightly torchft-nightly==$(TORCHFT_NIGHTLY)

test: typecheck browser etcd $(VENV)/$(NIGHTLY_MARK)
	$(VPY) -m pytest $(PYTEST_ARGS)

# The whole suite on the newest torch (the floor, torch 2.13.0, is `make test`'s): a venv of its
# own, .venv-newest (torch's CUDA wheel: ~4.6 GB, ~5 minutes to install; run on CPU here).
test-newest: browser etcd $(NEWEST_STAMP) $(VENV_NEWEST)/$(NIGHTLY_MARK)
	$(NPY) -m mypy
	$(NPY) -m pytest $(PYTEST_ARGS)

$(NPY):
	$(PY) -m venv $(VENV_NEWEST)
	$(NPY) -m pip install --quiet --upgrade pip

$(NEWEST_STAMP): $(NPY) pyproject.toml
	@$(NPY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_NEWEST)')" 2>/dev/null || \
	  $(NPY) -m pip install --quiet torch==$(TORCH_NEWEST)
	$(NPY) -m pip install --quiet -e '.[test]'
	@touch $@

# torchft-nightly's own integration tests (manager_integ_test.py, local_sgd_integ_test.py,
# diloco_regression_test.py, reconfigure_test.py), unchanged, against rallypoint through its
# torchft compatibility package (compat/torchft), on the newest torch: its tests need torch's
# native process-group reconfigure (torch >= 2.14).
torchft-nightly-check: $(NEWEST_STAMP) $(VENV_NEWEST)/$(NIGHTLY_MARK)
	RALLYPOINT_TORCHFT_NIGHTLY_CHECK=1 $(NPY) -m pytest tests/test_torchft_nightly_integ.py $(PYTEST_ARGS)

# TorchTitan's fault-tolerant training (torchtitan 0.3.0), unchanged, on rallypoint through the
# torchft compatibility package and on torchft 0.2.0 (tests/test_torchtitan.py), on CPU.
# .venv-titan is layered over .venv-newest (a .pth file: its torch 2.14.1, rallypoint, torchft
# 0.2.0) and gets only torchtitan and what its fault-tolerance path imports
# (tests/titan/requirements.txt, pinned, `--no-deps`: pip never touches torch); ~320 MB, ~15 s.
VENV_TITAN ?= .venv-titan
TPY := $(VENV_TITAN)/bin/python
TITAN_STAMP := $(VENV_TITAN)/.rallypoint-installed

$(TITAN_STAMP): $(NEWEST_STAMP) tests/titan/requirements.txt
	rm -rf $(VENV_TITAN)
	$(PY) -m venv --without-pip $(VENV_TITAN)
	$(NPY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
	  >"$$($(TPY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_newest_venv.pth"
	$(TPY) -m pip install --quiet --no-deps -r tests/titan/requirements.txt
	@touch $@

torchtitan-check: $(TITAN_STAMP)
	RALLYPOINT_TORCHTITAN_CHECK=1 $(TPY) -m pytest tests/test_torchtitan.py -p no:cacheprovider $(PYTEST_ARGS)

# The dashboard's test runs it in Debian's headless chromium: installed here when missing and
# apt can (root, a Debian package source); otherwise that one test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { timeout 300 apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
	    { timeout 120 apt-get update -qq >/dev/null 2>&1 && \
	      timeout 300 apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium could not be installed: the dashboard's browser test will be skipped"

# The etcd-backed lighthouse tests run real etcd clusters (tests/etcd_cluster.py) with
# Debian's etcd-server: installed here when missing and apt can, like chromium above, with
# the package's service kept from starting (a policy-rc.d saying no, in place only for the
# install when there is none already: invoke-rc.d and deb-systemd-invoke both ask it);
# otherwise those tests skip and say why.
etcd:
	@command -v etcd >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ( \
	  P=/usr/sbin/policy-rc.d; \
	  if [ ! -e $$P ]; then trap 'rm -f $$P' EXIT; trap 'exit 1' INT TERM; printf '#!/bin/sh\nexit 101\n' >$$P && chmod 755 $$P; fi; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  timeout 300 apt-get install -y -qq --no-install-recommends etcd-server >/dev/null 2>&1 || \
	    { timeout 120 apt-get update -qq >/dev/null 2>&1 && \
	      timeout 300 apt-get install -y -qq --no-install-recommends etcd-server >/dev/null 2>&1; } ) && \
	  command -v etcd >/dev/null 2>&1; } || \
	  echo "etcd could not be installed: the etcd-backed lighthouse tests will be skipped"

# The type checker over rallypoint/ (configured in pyproject.toml); part of `make test`.
typecheck: $(STAMP)
	$(VPY) -m mypy

# The wheel works outside the checkout: build the sdist and the wheel (`python -m build`),
# install the wheel and torch into a fresh venv in a temporary folder and, from there,
# run `rallypoint --help`, a lighthouse and two replica groups training a few steps
# (tools/wheel_check.py says what it checks). Part of CI.
wheel-check: $(STAMP)
	@$(VPY) -c "import build" 2>/dev/null || $(VPY) -m pip install --quiet build
	$(VPY) tools/wheel_check.py

# The documentation site (mkdocs.yml) into site/, with warnings as errors: a broken link
# between pages or to a heading, a page left out of the nav, a docstring griffe cannot
# parse; and (tools/docs_hooks.py) a link to a repository file that does not exist, a public
# name without an API reference entry. Needs only the `docs` extra's packages: the API
# reference is read from the source, nothing imported, no torch. Part of CI.
docs: $(DOCS_STAMP)
	$(VPY) -m mkdocs build --strict

$(DOCS_STAMP): $(VPY) pyproject.toml
	$(VPY) -c "import tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))" >$(VENV)/docs-requirements.txt
	$(VPY) -m pip install --quiet -r $(VENV)/docs-requirements.txt
	@touch $@

# Three replica groups (one `rallypoint run` each) train with DDP; one rank is SIGKILLed
# mid-step, its supervisor restarts the group, which heals from a live peer and rejoins.
demo: $(STAMP)
	$(VPY) examples/demo_training.py

# The lighthouse alone, with simulated replicas (crash detection and rejoin).
demo-lighthouse: $(STAMP)
	$(VPY) examples/demo_lighthouse.py

proto: $(STAMP)
	$(VPY) tools/gen_proto.py

bench: $(STAMP)
	$(VPY) bench/lighthouse.py
	$(VPY) bench/process_groups.py
	$(VPY) bench/transport.py

# On a GPU machine: every @pytest.mark.gpu test, then bench/gpu.py (NCCL and Baby NCCL
# allreduce, a 1 GB device heal over HTTP and a process group; rallypoint vs torchft 0.2.0 vs
# plain NCCL and cudaMemcpy), one summary table and one JSON line (also into $$OUT when set).
# No network and no .venv: it runs under the first Python whose torch sees CUDA (GPU_PY, then
# .venv/bin/python, then python3), with the wheels in .whl/ (`make gpu-wheels`, run where pip
# reaches PyPI) installed into a temporary folder. Exit 2 without a GPU (nothing is run), 3
# when rallypoint's modules do not import there (it names them), 1 when something failed.
# docs/development.md says how to read the table.
GPU_PY ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PY) tools/gpu_check.py $(GPU_CHECK_ARGS)

# The wheels gpu-check needs on a GPU image (Python 3.12), into .whl/: torchft 0.2.0 and what
# it imports, and the grpcio/protobuf/isal versions rallypoint needs (tools/gpu_check.py WHEELS).
gpu-wheels:
	$(PY) tools/gpu_check.py --download-wheels .whl

clean:
	rm -rf $(VENV) $(VENV_NEWEST) build site *.egg-info .pytest_cache
