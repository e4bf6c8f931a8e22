"""torchft's native module: only the lighthouse is needed by the integration tests."""

from rallypoint.lighthouse.server import LighthouseServer  # noqa: F401
