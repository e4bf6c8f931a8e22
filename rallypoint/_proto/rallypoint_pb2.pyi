from . import torchft_pb2 as _torchft_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttachHello(_message.Message):
    __slots__ = ("replica_id", "address", "leases", "lease_quorum_id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASE_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    leases: bool
    lease_quorum_id: int
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., leases: _Optional[bool] = ..., lease_quorum_id: _Optional[int] = ...) -> None: ...

class AttachGoodbye(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AttachPing(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("data", "step")
    DATA_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    data: str
    step: int
    def __init__(self, data: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("hello", "goodbye", "ping", "step_report")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    STEP_REPORT_FIELD_NUMBER: _ClassVar[int]
    hello: AttachHello
    goodbye: AttachGoodbye
    ping: AttachPing
    step_report: StepReport
    def __init__(self, hello: _Optional[_Union[AttachHello, _Mapping]] = ..., goodbye: _Optional[_Union[AttachGoodbye, _Mapping]] = ..., ping: _Optional[_Union[AttachPing, _Mapping]] = ..., step_report: _Optional[_Union[StepReport, _Mapping]] = ...) -> None: ...

class AttachWelcome(_message.Message):
    __slots__ = ("quorum_id", "heartbeat_timeout_ms", "last_quorum")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_QUORUM_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    heartbeat_timeout_ms: int
    last_quorum: _torchft_pb2.Quorum
    def __init__(self, quorum_id: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ..., last_quorum: _Optional[_Union[_torchft_pb2.Quorum, _Mapping]] = ...) -> None: ...

class PeerDown(_message.Message):
    __slots__ = ("replica_id", "reason")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    reason: str
    def __init__(self, replica_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaseGrant(_message.Message):
    __slots__ = ("quorum_id", "report_every")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_EVERY_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    report_every: int
    def __init__(self, quorum_id: _Optional[int] = ..., report_every: _Optional[int] = ...) -> None: ...

class LeaseRevoke(_message.Message):
    __slots__ = ("quorum_id", "reason", "replica_id", "after_step")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    reason: str
    replica_id: str
    after_step: int
    def __init__(self, quorum_id: _Optional[int] = ..., reason: _Optional[str] = ..., replica_id: _Optional[str] = ..., after_step: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("welcome", "peer_down", "lease_revoke")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    PEER_DOWN_FIELD_NUMBER: _ClassVar[int]
    LEASE_REVOKE_FIELD_NUMBER: _ClassVar[int]
    welcome: AttachWelcome
    peer_down: PeerDown
    lease_revoke: LeaseRevoke
    def __init__(self, welcome: _Optional[_Union[AttachWelcome, _Mapping]] = ..., peer_down: _Optional[_Union[PeerDown, _Mapping]] = ..., lease_revoke: _Optional[_Union[LeaseRevoke, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class KillReplicaRequest(_message.Message):
    __slots__ = ("replica_id", "reason")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    reason: str
    def __init__(self, replica_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class KillReplicaResponse(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class SupervisorEvent(_message.Message):
    __slots__ = ("group", "kind", "details")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    group: str
    kind: str
    details: str
    def __init__(self, group: _Optional[str] = ..., kind: _Optional[str] = ..., details: _Optional[str] = ...) -> None: ...

class ReportEventResponse(_message.Message):
    __slots__ = ("event_id",)
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    def __init__(self, event_id: _Optional[int] = ...) -> None: ...

class QuorumStripe(_message.Message):
    __slots__ = ("src_replica_ranks", "src_manager_addresses", "dst_replica_ranks")
    SRC_REPLICA_RANKS_FIELD_NUMBER: _ClassVar[int]
    SRC_MANAGER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DST_REPLICA_RANKS_FIELD_NUMBER: _ClassVar[int]
    src_replica_ranks: _containers.RepeatedScalarFieldContainer[int]
    src_manager_addresses: _containers.RepeatedScalarFieldContainer[str]
    dst_replica_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src_replica_ranks: _Optional[_Iterable[int]] = ..., src_manager_addresses: _Optional[_Iterable[str]] = ..., dst_replica_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class InjectRequest(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class InjectResponse(_message.Message):
    __slots__ = ("id", "replica_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    replica_id: str
    def __init__(self, id: _Optional[str] = ..., replica_id: _Optional[str] = ...) -> None: ...
