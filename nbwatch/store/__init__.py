"""The run folder's embedded store: one SQLite file, WAL while a run writes.

One writer thread per run (`RunStore`) batches records into a transaction at least every
`flush_interval` seconds, so a `kill -9` loses at most that much; any number of readers
(`RunReader`, this process or another) see every committed transaction while the run
writes. Scalars are stored as blocks (`nbwatch/store/blocks.py`): one row holds one key family's
values for the steps of one commit. The system sampler's readings are kept apart, on their
own wall-clock timeline (`system_samples`: wall, step and figures of every sample), so a
long step keeps all of them. Row ids are never reused (AUTOINCREMENT), so a
follower's `id > cursor` reads every row written after a resume's truncate. When the
writer closes, the WAL is folded into `nbwatch.db` and removed: a finished run is that one
file. On a shared filesystem (NFS, Lustre, GPFS: `mode.py`) the store is in network mode
instead: a rollback journal rather than WAL, and a heartbeat file (`lock.Heartbeat`)
rather than the folder's flock; `meta["store_mode"]` says which. Every SQL statement of
nbwatch lives in this package; the schema in `schema.py`.
"""

from .lock import RunInUse, check_no_writer, writer_alive
from .reader import RunReader
from .schema import DB_NAME, MAX_PENDING, SCHEMA_VERSION, StoreFailed, is_run_dir, send_command
from .writer import RunStore

__all__ = ["DB_NAME", "MAX_PENDING", "SCHEMA_VERSION", "RunInUse", "RunReader", "RunStore",
           "StoreFailed", "check_no_writer", "is_run_dir", "send_command", "writer_alive"]
