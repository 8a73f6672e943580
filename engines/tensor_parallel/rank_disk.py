"""A tp rank's share of the prefix cache's disk tier, and the entries every rank kept from a
previous run of the same plan.

Each rank writes its shard of an entry under the same file key (a digest of the entry's id
and tokens, which the coordinator named alike for every rank), in a directory namespaced by
model and share (`tp-RANKofWORLD`) and an identity that adds the KV settings, so a changed
plan never reads another's files. When the group starts, rank 0 lists its entries (oldest
first) and every rank says which it holds, in one `all_sum`: an entry every rank holds gets
the same new id everywhere (counting down from TOP_ENTRY_ID, below which the engine names
its own); one any rank lacks is removed on every rank, so a hit never names a missing shard.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

from engines.prefix_cache.disk_tier import DiskTier, StoredEntry, tier_root
from engines.tensor_parallel.group import WorkerSpec
from engines.tensor_parallel.lockstep import TOP_ENTRY_ID, Lockstep

log = logging.getLogger(__name__)

KEY_BYTES = 12  # disk_tier's file keys: 12-byte BLAKE2 digests in hex
KEY_WORDS = KEY_BYTES // 4


def open_rank_disk(spec: WorkerSpec) -> tuple[DiskTier | None, list[StoredEntry]]:
    """This rank's disk tier (None without a budget or a directory) and the valid entries it
    found there, oldest first."""
    options = spec.options
    if not options.prefix_cache_bytes or not options.prefix_cache_disk_bytes:
        return None, []
    if not options.prefix_cache_dir:
        log.warning("prefix cache: no cache directory on this machine, so no disk tier")
        return None, []
    share = f"tp-{spec.rank}of{spec.world_size}"
    root = tier_root(Path(options.prefix_cache_dir), Path(spec.model_path), share)
    disk = DiskTier(root, identity=disk_identity(spec, root))
    return disk, disk.open()


def disk_identity(spec: WorkerSpec, root: Path) -> str:
    """What an entry's KV depends on: the model and share (the root's last two names, so a
    cache directory moved whole still reads), its quantization and its dtype. Files written
    under another identity are never read."""
    options = spec.options
    quantized = f"|kv{options.kv_bits}from{options.quantized_kv_start}" if options.kv_bits else ""
    dtype = "|float32" if options.upcast else ""
    return f"{root.parent.name}/{root.name}{quantized}{dtype}"


def agree_on_stored(
    lockstep: Lockstep, disk: DiskTier | None, stored: list[StoredEntry]
) -> list[list]:
    """Every rank, at start-up: list the entries every rank holds under ids all agree on and
    remove the rest. Returns [[entry id, tokens, bytes on this rank], ...] (rank 0's: the
    engine indexes them)."""
    mine = {key_words(entry.key): entry for entry in stored}
    offered = [words for words in mine if words is not None] if lockstep.rank == 0 else []
    (count,) = lockstep.broadcast([len(offered)], 1)
    flat = lockstep.broadcast([word for words in offered for word in words], count * KEY_WORDS)
    keys = [tuple(flat[at : at + KEY_WORDS]) for at in range(0, len(flat), KEY_WORDS)]
    holders = lockstep.sum_across_ranks([int(key in mine) for key in keys]) if keys else []
    agreed = []
    for position, (key, held) in enumerate(zip(keys, holders, strict=True)):
        entry = mine.pop(key, None)
        if entry is not None and held == lockstep.world_size:
            entry_id = TOP_ENTRY_ID - position
            disk.adopt(entry_id, entry)
            agreed.append([entry_id, list(entry.tokens), entry.nbytes])
        elif entry is not None:
            disk.discard(entry)  # another rank lacks its shard: no hit may name it
    for entry in mine.values():
        disk.discard(entry)  # rank 0 has no shard of it
    if stored:
        log.info(
            "prefix cache: %d of %d entries on disk every rank holds", len(agreed), len(stored)
        )
    return agreed


def key_words(key: str) -> tuple[int, ...] | None:
    """A file key as int32 words for the broadcast; None when it is not one of ours."""
    try:
        data = bytes.fromhex(key)
    except ValueError:
        return None
    if len(data) != KEY_BYTES:
        return None
    return struct.unpack(f"<{KEY_WORDS}i", data)
