"""The wire contract: committed stubs match proto/, and torchft 0.2's field numbers hold
(plus the three fields torchft 0.3 added)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    written = _gen_module().generate(tmp_path / "_proto")
    committed = ROOT / "rallypoint" / "_proto"
    fresh_names = sorted(p.name for p in written)
    assert fresh_names == sorted(p.name for p in committed.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    for p in written:
        assert p.read_text() == (committed / p.name).read_text(), f"{p.name} is stale: run `make proto` and commit"


# torchft 0.2.0's wire contract, plus torchft 0.3's reconfigure handles: message -> {field: (number, type)}.
TORCHFT_FIELDS = {
    "QuorumMember": {
        "replica_id": (1, "string"), "address": (2, "string"), "store_address": (3, "string"),
        "step": (4, "int64"), "world_size": (5, "uint64"), "shrink_only": (6, "bool"),
        "data": (7, "string"), "commit_failures": (8, "int64"),
        "reconfigure_handles": (9, "string"),  # torchft 0.3
    },
    "Quorum": {"quorum_id": (1, "int64"), "participants": (2, "message"), "created": (3, "message")},
    "LighthouseQuorumRequest": {"requester": (1, "message")},
    "LighthouseQuorumResponse": {"quorum": (1, "message")},
    "LighthouseHeartbeatRequest": {"replica_id": (1, "string")},
    "ManagerQuorumRequest": {
        "group_rank": (1, "int64"), "step": (2, "int64"), "checkpoint_metadata": (3, "string"),
        "shrink_only": (4, "bool"), "init_sync": (5, "bool"), "commit_failures": (6, "int64"),
        "reconfigure_handle": (7, "string"),  # torchft 0.3
    },
    "ManagerQuorumResponse": {
        "quorum_id": (1, "int64"), "recover_src_manager_address": (2, "string"),
        "recover_src_replica_rank": (3, "int64"), "recover_dst_replica_ranks": (4, "int64"),
        "store_address": (5, "string"), "max_step": (6, "int64"), "max_replica_rank": (7, "int64"),
        "max_world_size": (8, "int64"), "replica_rank": (9, "int64"), "replica_world_size": (10, "int64"),
        "heal": (11, "bool"), "commit_failures": (12, "int64"), "replica_ids": (13, "string"),
        "reconfigure_handles": (14, "string"),  # torchft 0.3
    },
    "CheckpointMetadataRequest": {"rank": (1, "int64")},
    "CheckpointMetadataResponse": {"checkpoint_metadata": (1, "string")},
    "ShouldCommitRequest": {"should_commit": (1, "bool"), "group_rank": (2, "int64"), "step": (3, "int64")},
    "ShouldCommitResponse": {"should_commit": (1, "bool")},
    "KillRequest": {"msg": (1, "string")},
}
OPTIONAL = {("ManagerQuorumResponse", "recover_src_replica_rank"), ("ManagerQuorumResponse", "max_replica_rank")}
REPEATED = {("Quorum", "participants"), ("ManagerQuorumResponse", "recover_dst_replica_ranks"),
            ("ManagerQuorumResponse", "replica_ids"), ("QuorumMember", "reconfigure_handles"),
            ("ManagerQuorumResponse", "reconfigure_handles")}


@pytest.mark.parametrize("message", sorted(TORCHFT_FIELDS))
def test_torchft_field_numbers_and_types(message: str) -> None:
    from google.protobuf.descriptor import FieldDescriptor

    from rallypoint._proto import torchft_pb2

    desc = torchft_pb2.DESCRIPTOR.message_types_by_name[message]
    assert desc.full_name == f"torchft.{message}"
    names = {
        FieldDescriptor.TYPE_STRING: "string", FieldDescriptor.TYPE_INT64: "int64",
        FieldDescriptor.TYPE_UINT64: "uint64", FieldDescriptor.TYPE_BOOL: "bool",
        FieldDescriptor.TYPE_MESSAGE: "message",
    }
    assert {f.name for f in desc.fields} == set(TORCHFT_FIELDS[message]), "no field may be added or dropped"
    for name, (number, typ) in TORCHFT_FIELDS[message].items():
        f = desc.fields_by_name[name]
        assert (f.number, names[f.type]) == (number, typ), f"{message}.{name}"
        repeated = (message, name) in REPEATED
        assert f.is_repeated == repeated, f"{message}.{name} repeated-ness"
        singular_message = typ == "message" and not repeated
        assert f.has_presence == ((message, name) in OPTIONAL or singular_message), f"{message}.{name} optional-ness"


def test_services_keep_torchft_method_paths() -> None:
    from rallypoint._proto import torchft_pb2

    services = torchft_pb2.DESCRIPTOR.services_by_name
    assert [m.name for m in services["LighthouseService"].methods] == ["Quorum", "Heartbeat"]
    assert [m.name for m in services["ManagerService"].methods] == ["Quorum", "CheckpointMetadata", "ShouldCommit", "Kill"]


def test_our_additions_live_in_their_own_package() -> None:
    from rallypoint._proto import rallypoint_pb2

    assert rallypoint_pb2.DESCRIPTOR.package == "rallypoint"
    assert "torchft.proto" in [d.name for d in rallypoint_pb2.DESCRIPTOR.dependencies]
    methods = [m.name for m in rallypoint_pb2.DESCRIPTOR.services_by_name["RallypointLighthouse"].methods]
    assert methods == ["Attach", "Status", "KillReplica", "ReportEvent", "Inject"]


def test_lighthouse_side_imports_no_torch() -> None:
    """The lighthouse must start fast and run on hosts without torch."""
    import subprocess

    code = (
        "import sys\n"
        "import rallypoint, rallypoint.cli, rallypoint.lighthouse.server, rallypoint.lighthouse.client\n"
        "import rallypoint.lighthouse.http, rallypoint.lighthouse.state\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') or m == 'torchft')\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
