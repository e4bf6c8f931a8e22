from rallypoint.manager.manager import Manager, WorldSizeMode  # noqa: F401
