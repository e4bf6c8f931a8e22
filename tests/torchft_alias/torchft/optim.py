from rallypoint.integrations.optim import OptimizerWrapper  # noqa: F401
