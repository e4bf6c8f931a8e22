"""Size limits of every string field that arrives over the network, checked before the
value is used, stored or fanned out (a 5 MiB goodbye reason once broke every replica's
liveness stream when the lighthouse forwarded it). One table for the lighthouse and the
managers, so the limits cannot diverge."""

from __future__ import annotations

MAX_REPLICA_ID_BYTES = 256
MAX_ADDRESS_BYTES = 1024  # a host:port, a URL, a store address
MAX_REASON_BYTES = 1024  # kill and goodbye reasons
MAX_DATA_BYTES = 64 * 1024  # a quorum request's JSON step statistics
MAX_CHECKPOINT_METADATA_BYTES = 4096  # what a rank tells its peers about where to heal from
MAX_EVENT_DETAILS_BYTES = 4096  # a supervisor event's JSON fields (ReportEvent)
MAX_RECONFIGURE_HANDLE_BYTES = 4096  # one rank's process-group reconfigure handle (torchft 0.3, JSON)
MAX_GROUP_HANDLES = 4096  # the most ranks of one replica group that send reconfigure handles
MAX_GROUP_HANDLES_BYTES = 1024 * 1024  # all of one replica group's reconfigure handles together


def utf8_len(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


def clip(value: str, limit: int) -> str:
    """``value`` cut to at most ``limit`` UTF-8 bytes, marked when cut (for text that is
    only logged or forwarded, such as a goodbye reason)."""
    if utf8_len(value) <= limit:
        return value
    mark = " …(cut)"
    return value.encode("utf-8", "surrogatepass")[: limit - utf8_len(mark)].decode("utf-8", "ignore") + mark


__all__ = ["MAX_ADDRESS_BYTES", "MAX_CHECKPOINT_METADATA_BYTES", "MAX_DATA_BYTES", "MAX_EVENT_DETAILS_BYTES",
           "MAX_GROUP_HANDLES", "MAX_GROUP_HANDLES_BYTES", "MAX_REASON_BYTES", "MAX_RECONFIGURE_HANDLE_BYTES",
           "MAX_REPLICA_ID_BYTES", "clip", "utf8_len"]
