"""A directory of cluster files for a multilingual model, and the choice of one for a run.

``fastgen-train-clusters`` on a multilingual model writes one cluster file per
language direction (``direction.SRC-TGT.pt``, scope ``direction``) or per target
language (``target.TGT.pt``, scope ``target``) into a directory, and
``index.json`` beside them::

    {"format": "fairseq_fastgen cluster index", "version": 1,
     "model": {"vocab_size": ..., "hidden_size": ..., "projection_sha256": ...},
     "files": {"direction.en-fr.pt": {"scope": "direction", "source_lang": "en", "target_lang": "fr"},
               "target.fr.pt": {"scope": "target", "source_lang": null, "target_lang": "fr"}}}

Both scopes may share a directory (two runs, one per scope).
``--cluster-projection DIR`` takes, for the run's ``--source-lang`` and
``--target-lang``, the direction's file, else the target language's file, and
refuses a direction that has neither, naming those the directory serves.
Every file and the index are written atomically; the index is written last,
so it never names a file that is not whole.
"""

import json
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from fairseq_fastgen.cluster.clusterfile import ClusterFile, ClusterFileError, ModelFingerprint
from fairseq_fastgen.safe_files import remove_stale_temporaries, write_atomically

INDEX_NAME = "index.json"
INDEX_FORMAT = "fairseq_fastgen cluster index"
INDEX_VERSION = 1

Direction = Tuple[Optional[str], Optional[str]]  # (source language, target language) of a run


def file_name(scope: str, source_lang: Optional[str], target_lang: str) -> str:
    return f"direction.{source_lang}-{target_lang}.pt" if scope == "direction" else f"target.{target_lang}.pt"


def entry_of(cluster_file: ClusterFile) -> Dict[str, Optional[str]]:
    """The index entry of a file: its scope and languages."""
    return {"scope": cluster_file.scope, "source_lang": cluster_file.source_lang,
            "target_lang": cluster_file.target_lang}


def run_direction(task) -> Optional[Direction]:
    """The languages a task translates (``--source-lang``, ``--target-lang``), or None for a task
    without them (language models, a multilingual task set up for training)."""
    cfg = getattr(task, "cfg", None) or getattr(task, "args", None)
    source, target = getattr(cfg, "source_lang", None), getattr(cfg, "target_lang", None)
    return (source, target) if source is not None and target is not None else None


class ClusterIndex:
    """``DIR/index.json``: the model the files were made for and each file's scope and languages."""

    def __init__(self, directory: Path, fingerprint: ModelFingerprint, files: Dict[str, Dict[str, Optional[str]]]):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.files = files  # file name -> entry (entry_of)

    @classmethod
    def read(cls, directory) -> "ClusterIndex":
        directory = Path(directory)
        path = directory / INDEX_NAME
        if not path.is_file():
            raise ClusterFileError(f"{directory} has no {INDEX_NAME}: it is not a directory written by "
                                   f"fastgen-train-clusters (give a cluster file or such a directory)")
        try:
            index = json.loads(path.read_text())
            if index.get("format") != INDEX_FORMAT:
                raise ValueError(f"format is {index.get('format')!r}")
            if index.get("version") != INDEX_VERSION:
                raise ValueError(f"version {index.get('version')} (this fairseq_fastgen reads {INDEX_VERSION})")
            return cls(directory, ModelFingerprint(**index["model"]), dict(index["files"]))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ClusterFileError(f"{path} is not a cluster index of fastgen-train-clusters ({error})") from error

    def write(self):
        index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "model": asdict(self.fingerprint),
                 "files": dict(sorted(self.files.items()))}
        write_atomically(self.directory / INDEX_NAME, lambda f: f.write(json.dumps(index, indent=2).encode()))

    def served(self) -> str:
        """The directions the files serve, in words (for refusals)."""
        directions = sorted(f"{e['source_lang']}-{e['target_lang']}" for e in self.files.values()
                            if e["scope"] == "direction")
        targets = sorted(f"*-{e['target_lang']}" for e in self.files.values() if e["scope"] == "target")
        return ", ".join(directions + [f"{t} (scope target)" for t in targets]) or "none"

    def choose(self, direction: Optional[Direction]) -> Tuple[Path, Dict[str, Optional[str]]]:
        """The file for ``direction``: the direction's own file, else its target language's."""
        if direction is None:
            raise ClusterFileError(f"--cluster-projection {self.directory} holds files per language direction "
                                   f"({self.served()}); this run names no --source-lang and --target-lang")
        source, target = direction
        for scope, wanted_source in (("direction", source), ("target", None)):
            for name, entry in sorted(self.files.items()):
                if (entry["scope"], entry["source_lang"], entry["target_lang"]) == (scope, wanted_source, target):
                    return self.directory / name, entry
        raise ClusterFileError(f"--cluster-projection {self.directory} has no cluster file for {source}-{target}; "
                               f"it has {self.served()}")


def load_for_direction(directory, direction: Optional[Direction]) -> Tuple[ClusterFile, Path]:
    """The cluster file of ``directory`` for ``direction``, checked against its index entry."""
    index = ClusterIndex.read(directory)
    path, entry = index.choose(direction)
    cluster_file = ClusterFile.load(path)
    if cluster_file.fingerprint != index.fingerprint:
        raise ClusterFileError(f"{path} was made for another model than {directory / INDEX_NAME} names "
                               f"({', '.join(cluster_file.fingerprint.differences(index.fingerprint))}: file vs index)")
    if entry_of(cluster_file) != entry:
        raise ClusterFileError(f"{path} holds the clusters of {cluster_file.serves()} (scope {cluster_file.scope}), "
                               f"but {INDEX_NAME} lists it as scope {entry['scope']} "
                               f"{entry['source_lang'] or '*'}-{entry['target_lang']}: rebuild the directory "
                               f"with fastgen-train-clusters")
    return cluster_file, path


def write_directory(directory, cluster_files: List[ClusterFile]) -> List[Path]:
    """Write ``cluster_files`` into ``directory`` (created when absent) and add them to its index.

    Files of the index that ``cluster_files`` do not replace stay listed (e.g. the other scope's);
    a directory whose index names another model is refused."""
    directory = Path(directory)
    directory.mkdir(exist_ok=True)
    remove_stale_temporaries(directory)  # of a run that was killed
    fingerprint = cluster_files[0].fingerprint
    index = ClusterIndex(directory, fingerprint, {})
    if (directory / INDEX_NAME).exists():
        index = ClusterIndex.read(directory)
        if index.fingerprint != fingerprint:
            raise ClusterFileError(f"{directory} holds the cluster files of another model "
                                   f"({', '.join(index.fingerprint.differences(fingerprint))}: index vs model); "
                                   f"write into another directory")
    paths = []
    for cluster_file in cluster_files:
        name = file_name(cluster_file.scope, cluster_file.source_lang, cluster_file.target_lang)
        cluster_file.save(directory / name)
        index.files[name] = entry_of(cluster_file)
        paths.append(directory / name)
    index.write()
    return paths
