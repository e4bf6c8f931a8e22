from rallypoint.integrations.ddp import DistributedDataParallel  # noqa: F401
