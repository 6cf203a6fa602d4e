"""The archive: what the agent keeps in SQL (an embedded SQLite file, or a fleet PostgreSQL).

``database`` opens and migrates the database, ``models`` is the schema that the migrations build,
``rollups`` writes the telemetry rollups. Callers get an ``ArchiveError`` (one line, never a
password) for anything the database refuses.
"""

from agent.archive.database import ArchiveError, current_revision, open_engine, upgrade
from agent.archive.rollups import RollupWriter

__all__ = ["ArchiveError", "RollupWriter", "current_revision", "open_engine", "upgrade"]
