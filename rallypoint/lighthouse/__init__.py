"""The lighthouse: forms a quorum of the live replica groups before every step.

Imports no torch. Submodules: ``quorum`` (pure rules), ``core`` (loop-bound state),
``server`` (gRPC service + ``LighthouseServer``), ``state`` (SQLite persistence),
``http`` (dashboard, /status, /metrics), ``client`` (clients the manager uses).
"""
