"""``torchft.manager``: rallypoint's :class:`~rallypoint.manager.manager.Manager`."""

from rallypoint.manager.manager import Manager, WorldSizeMode

__all__ = ["Manager", "WorldSizeMode"]
