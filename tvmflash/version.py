"""tvmflash's version: in every build's cache key and every tuning record."""

__version__ = "0.1.0"
