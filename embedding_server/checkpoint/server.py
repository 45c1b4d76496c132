"""An embedding server's checkpoints: snapshot between steps, write in the background.

On a CHECKPOINT command (``wire.py``: the step, the base of a delta, whether everyone waits) the
server copies the rows its pieces trained (since the base, for a delta: ``checkpoint/snapshot.py``)
and its stage's state (a tower module), hands them to its writer thread, and answers the next
command at once: a shard that takes longer than ``dist.timeout_s`` to write stops nothing. Its
record in the partial directory tells the master's finaliser that its part is durable.
"""

from __future__ import annotations

import logging
from pathlib import Path

from embedding_server.checkpoint.files import partial_dir
from embedding_server.checkpoint.snapshot import CutRequest, snapshot_tables
from embedding_server.checkpoint.writer import CheckpointWriter

log = logging.getLogger(__name__)


class ServerCheckpoints:
    """Checkpoint cuts of one embedding server.

    Args:
        root: the job's checkpoints directory.
        writer: its background writer (default: one named after the server, unthrottled).
    """

    def __init__(self, root: Path, index: int, writer: CheckpointWriter | None = None) -> None:
        self.root = Path(root)
        self.index = index
        self.writer = writer or CheckpointWriter(f"server-{index}")

    def cut(self, server, cut: CutRequest) -> None:
        """Snapshot ``server``'s shard and stage for ``cut``; the writer writes them."""
        directory = partial_dir(self.root, cut.step)  # made fresh by the master before the header
        files, record = {}, {"pieces": []}
        if server.shard is not None:
            files, record = snapshot_tables(
                server.shard, cut.base_step, f"embeddings-server-{self.index}"
            )
            server.shard.touched.close_cut(cut.step)
        files.update(server.stage.snapshot())
        self.writer.submit(directory, files, record)
        log.debug(
            "server %d: checkpoint step %d snapshot handed to the writer (%d files)",
            self.index,
            cut.step,
            len(files),
        )

    def close(self, timeout_s: float) -> None:
        """Finish what is being written (bounded by ``timeout_s``)."""
        if not self.writer.close(timeout_s):
            log.error(
                "server %d: checkpoint writes did not finish within %.0fs", self.index, timeout_s
            )
