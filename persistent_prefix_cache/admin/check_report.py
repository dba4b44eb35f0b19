"""What ``ppc check`` found (and, with ``--fix``, repaired): `CheckReport`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CheckReport:
    """What `StoreAdmin.check` found (and, with ``fix``, repaired)."""

    nodes: int = 0
    files_verified: int = 0  # blocks whose bytes were read and verified
    segments_verified: int = 0  # the segment files those blocks live in
    problems: list[tuple[str, str]] = field(default_factory=list)
    removed_nodes: int = 0
    removed_files: int = 0
    fixed: bool = False
    remaining: list[tuple[str, str]] = field(default_factory=list)  # problems found again after the fix
    notes: list[str] = field(default_factory=list)  # what was not checked, and why
    rebuild: dict | None = None  # what a rebuild of the index did (`rebuild.RebuildReport`)
    unfixed: list[str] = field(default_factory=list)  # what --fix could not settle here, and why

    @property
    def clean(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {
            "clean": self.clean,
            "nodes": self.nodes,
            "files_verified": self.files_verified,
            "blocks_verified": self.files_verified,
            "segments_verified": self.segments_verified,
            "problems": [{"kind": k, "detail": d} for k, d in self.problems],
            "fixed": self.fixed,
            "remaining": [{"kind": k, "detail": d} for k, d in self.remaining],
            "removed_nodes": self.removed_nodes,
            "removed_files": self.removed_files,
            "notes": self.notes,
            "rebuild": self.rebuild,
            "unfixed": self.unfixed,
        }
