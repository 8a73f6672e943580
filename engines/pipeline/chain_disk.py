"""A pp stage's share of the prefix cache's disk tier, kept across chain sessions.

Entry ids belong to one session (runner uids, or ids given when entries are listed again),
and a stage past stage 0 never sees an entry's tokens, so neither can name a file for good.
Every stage names an entry's files by the session's name (random, chosen by the coordinator)
and the entry id: the same name on every stage, never reused. Each session reopens the tier,
which lists the files on disk; the coordinator lists stage 0's entries again (their files
hold the tokens) under fresh ids and asks every stage in a roll call to adopt the same files
under those ids. A stage reports the files it lacks (the coordinator forgets those entries
everywhere) and removes every file it was not asked to adopt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from engines.pipeline.sequence_documents import DiskRollCall
from engines.prefix_cache.disk_tier import DiskTier, StoredEntry, tier_root


class ChainDiskTier(DiskTier):
    """A DiskTier whose files are named by the chain session and the entry id."""

    def __init__(self, root: Path, identity: str) -> None:
        super().__init__(root, identity)
        self.session = ""  # the name new files take, set by the session's roll call

    def entry_key(self, entry_id: int, tokens: tuple[int, ...]) -> str:
        return hashlib.blake2b(repr((self.session, entry_id)).encode(), digest_size=12).hexdigest()


def chain_disk_tier(
    cache_dir: Path, model_path: Path, layers: range, kv_bits: int, quantized_kv_start: int
) -> ChainDiskTier:
    """One stage's disk tier for `layers` of a model under a machine's cache directory, not
    opened yet (every session reopens it: SessionDisk). Entries of another KV quantization
    are another cache's: its identity names the quantization."""
    root = tier_root(cache_dir, model_path, f"layers-{layers.start}-{layers.stop}")
    quantized = f"|kv{kv_bits}from{quantized_kv_start}" if kv_bits else ""
    return ChainDiskTier(root, identity=str(root) + quantized)


class SessionDisk:
    """A ChainDiskTier over one session: reopened when the session starts (the previous
    session's writes finish first), the files found then waiting to be adopted or removed."""

    def __init__(self, disk: ChainDiskTier) -> None:
        disk.close()
        self.disk = disk
        self._found = {stored.key: stored for stored in disk.open()}  # oldest first

    def found(self) -> list[StoredEntry]:
        """The entries on disk not adopted yet, oldest first."""
        return list(self._found.values())

    def adopt(self, order: DiskRollCall) -> list[int]:
        """Carry out a roll call's order; returns the entries whose files are not here."""
        self.disk.session = order.session
        missing = []
        for entry, key in order.adopt:
            stored = self._found.pop(key, None)
            if stored is None:
                missing.append(entry)
            else:
                self.disk.adopt(entry, stored)
        if order.complete:
            self._remove(self._found.values())
            self._found.clear()
        return missing

    def _remove(self, entries: Iterable[StoredEntry]) -> None:
        for stored in entries:
            self.disk.discard(stored)
