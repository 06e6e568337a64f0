"""Files whose rename must survive a crash once a database row names them."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(folder: Path) -> None:
    """Flush a folder's entries: a rename into it is on disk only once this returns, so a
    COMMIT that names the renamed file must come after it."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
