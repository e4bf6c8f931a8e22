from rallypoint.integrations.local_sgd import DiLoCo, LocalSGD  # noqa: F401
