from rallypoint.integrations.data import DistributedSampler  # noqa: F401
