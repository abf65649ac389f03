"""Files a checkpoint directory names must be inside it.

A checkpoint comes from anyone: a shard an index names, or a file such as
``chat_template.jinja``, may be a symbolic link (or a ``..`` path) that leads elsewhere
on the machine. :func:`escapes` says where such a path really goes. A Hugging Face hub
cache snapshot (``<repo>/snapshots/<rev>``) is the one legitimate exception: its files are
links into the repository's own ``blobs`` folder.
"""

from __future__ import annotations

from pathlib import Path


def hf_blobs(snapshot: Path) -> list[Path]:
    """The blob store of a Hugging Face hub cache snapshot (``<repo>/snapshots/<rev>``,
    whose files are symlinks into ``<repo>/blobs``), where its files may point."""
    blobs = snapshot.parent.parent / "blobs"
    return [blobs] if snapshot.parent.name == "snapshots" and blobs.is_dir() else []


def escapes(root: Path, rel: Path) -> Path | None:
    """Where ``root / rel`` resolves when that is outside ``root`` (and outside a hub
    snapshot's blob store); None when it stays inside."""
    root = root.resolve()
    target = (root / rel).resolve()
    if any(target.is_relative_to(a) for a in [root, *hf_blobs(root)]):
        return None
    return target
