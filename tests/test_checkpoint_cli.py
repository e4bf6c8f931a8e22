"""``rallypoint run --checkpoint-dir DIR [--checkpoint-every N --checkpoint-keep K]``:
the flags become every rank's ``RALLYPOINT_CHECKPOINT_*``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rallypoint.supervisor.args import UsageError, add_run_parser, checkpoint_env, config_from_args
from rallypoint.supervisor.envs import GroupSpec, rank_env


def parse(tmp_path: Path, *flags: str):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    parser = argparse.ArgumentParser()
    add_run_parser(parser.add_subparsers())
    return config_from_args(parser.parse_args(["run", *flags, str(script)]))


def test_flags_set_the_ranks_environment(tmp_path: Path) -> None:
    from rallypoint.supervisor.supervisor import Supervisor

    cfg = parse(tmp_path, "--checkpoint-dir", "/ck", "--checkpoint-every", "20", "--checkpoint_keep", "2")
    assert dict(cfg.extra_env) == {"RALLYPOINT_CHECKPOINT_DIR": "/ck", "RALLYPOINT_CHECKPOINT_EVERY": "20",
                                   "RALLYPOINT_CHECKPOINT_KEEP": "2"}
    sup = Supervisor(cfg, environ={"RALLYPOINT_CHECKPOINT_DIR": "/old", "OTHER": "1"})
    env = rank_env(sup._environ, GroupSpec(1, "127.0.0.1", 1234), 0, 0)
    assert env["RALLYPOINT_CHECKPOINT_DIR"] == "/ck" and env["RALLYPOINT_CHECKPOINT_EVERY"] == "20"
    assert env["OTHER"] == "1"
    assert parse(tmp_path).extra_env == ()


@pytest.mark.parametrize("directory,every,keep,message", [
    (None, 5, None, "need --checkpoint-dir"),
    ("/ck", 0, None, "--checkpoint-every must be at least 1"),
    ("/ck", None, -1, "--checkpoint-keep must not be negative"),
    (" ", None, None, "--checkpoint-dir is empty"),
])
def test_bad_flags_are_usage_errors(directory: str | None, every: int | None, keep: int | None,
                                    message: str) -> None:
    with pytest.raises(UsageError, match=message):
        checkpoint_env(directory, every, keep)


def test_only_the_folder(tmp_path: Path) -> None:
    assert checkpoint_env("s3://b/run", None, None) == {"RALLYPOINT_CHECKPOINT_DIR": "s3://b/run"}
