"""The coordinator's side of a disk tier that outlives chain sessions (chain_disk.py): when a
session starts, stage 0's entries on disk are listed again under fresh ids, every stage is
asked in a roll call to adopt its files of them, and an entry any stage lacks is forgotten
everywhere (a later prompt sharing its prefix prefills it: a miss, never wrong KV).
"""

from __future__ import annotations

import logging
import secrets

from engines.pipeline import wire
from engines.pipeline.chain_disk import SessionDisk
from engines.pipeline.sequence_documents import DiskRollCall
from engines.pipeline.wire import Kind

log = logging.getLogger(__name__)

ADOPT_PER_ROLL_CALL = 500  # [id, key] pairs per STATUS document: far below MAX_JSON_BYTES


class DiskRelisting:
    """Part of EncryptedPipelineEngine (engine.py), which owns the `_disk` tier of stage 0,
    the prefix cache's `books`, stage 0's `_local` batches and the `_chain`; prefix_keeping.py
    carries out and sends the books' orders, chain_upkeep.py numbers and sends the roll calls."""

    def _relist_disk_entries(self) -> None:
        """A new session: the entries a previous one left on disk, as far as every stage
        holds them and the disk budget keeps them (oldest first, so the newest stay)."""
        shelf = SessionDisk(self._disk)
        named = []
        index = self.books.index
        for stored in shelf.found():
            entry = self.books.take_private_id()
            nbytes = self._entry_bytes(len(stored.tokens), stored.nbytes)
            # past the budget: not listed, so adopting the listed ones below removes its files
            index.restore(entry, stored.tokens, nbytes)
            named.append((entry, stored.key))
        listed = [(entry, key) for entry, key in named if entry in index]
        session = secrets.token_hex(8)  # names the files this session writes, on every stage
        shelf.adopt(DiskRollCall(session, tuple(listed)))  # here: the other files go
        missing = self._adopt_on_every_stage(session, listed)
        self.books.discard(missing)  # each counted as a disk failure
        if missing:
            self._send_end(self._orders_on_stage_zero())
        if listed:
            log.info(
                "prefix cache: %d of %d entries on disk listed again (%d missing on a stage)",
                len(listed) - len(missing), len(named), len(missing),
            )  # fmt: skip

    def _adopt_on_every_stage(self, session: str, listed: list[tuple[int, str]]) -> list[int]:
        """STATUS roll calls asking every stage to adopt its files of `listed` (and remove
        the rest, with the last); returns the entries any stage lacks."""
        size = ADOPT_PER_ROLL_CALL
        chunks = [listed[start : start + size] for start in range(0, len(listed), size)] or [[]]
        missing: set[int] = set()
        for index, chunk in enumerate(chunks):
            order = DiskRollCall(session, tuple(chunk), complete=index == len(chunks) - 1)
            number = self._take_number()
            document = {"reports": [self._local_report()], "disk": order.document()}
            self._send(wire.document_frame(Kind.STATUS, number, document))
            answer = wire.receive_answer(
                self._chain.inbound, self.token_timeout_s, wire.Frame(Kind.READY, number),
                self._chain.last_layers,
            )  # fmt: skip
            for report in answer.document().get("reports", []):
                listed_missing = report.get("missing", []) if isinstance(report, dict) else []
                missing.update(entry for entry in listed_missing if isinstance(entry, int))
        return sorted(missing & {entry for entry, _ in listed})
