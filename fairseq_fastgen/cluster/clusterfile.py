"""The cluster file written by ``fastgen-train-clusters``: format, checks, I/O.

One file serves one model and either one language direction (scope
``direction``) or one target language, whatever the source (scope ``target``:
a multilingual model's states of every direction into that language, pooled).
It holds

* ``centroids`` (clusters, hidden) float32 and their squared norms (clusters,);
* the active token set of every cluster in CSR form: cluster ``c`` owns
  ``tokens[offsets[c]:offsets[c + 1]]`` (ascending token ids);
* where made by this version: each cluster's estimate of the softmax mass outside
  its active tokens, ``outside_intercepts`` (clusters,) and ``outside_gradients``
  (clusters, hidden) float32 (``outside_mass.py``; files without them normalise
  over the active tokens);
* a fingerprint of the model it was made for (vocabulary size, hidden size,
  SHA-256 of the output projection), the scope and languages it serves
  (scope, source and target language; the source is None for scope ``target``)
  and plain metadata (top-K, number of clustered states, how it was trained,
  the directions whose states it holds).

On disk it is ``torch.save`` of a dict of tensors and plain values, read back
with ``weights_only=True``; a SHA-256 over the metadata and every tensor's bytes
detects a corrupted file, and torch's zip reader refuses a truncated one.
It is written to a temporary name and renamed (``safe_files``), so a killed
run leaves the file whole or absent.  Version 1 files (before scopes) are read
as scope ``direction``.
"""

import hashlib
import json
import pickle
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq_fastgen.checkpoint_safety import reader_said
from fairseq_fastgen.ops.cluster_union import ClusterActiveSets
from fairseq_fastgen.option_checks import UsageError
from fairseq_fastgen.safe_files import write_atomically

FORMAT_NAME = "fairseq_fastgen cluster projection"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 has no scope: it served one direction
SCOPES = ("direction", "target")
TENSOR_NAMES = ("centroids", "centroid_sqnorms", "offsets", "tokens")
ESTIMATE_NAMES = ("outside_intercepts", "outside_gradients")  # optional: files made before the estimate lack them


class ClusterFileError(UsageError):
    """A cluster file that cannot be used (unreadable, inconsistent, or made for another model)."""


@dataclass(frozen=True)
class ModelFingerprint:
    """What identifies the vocabulary projection a cluster file was made for."""

    vocab_size: int
    hidden_size: int
    projection_sha256: str

    @classmethod
    def of_decoder(cls, decoder) -> "ModelFingerprint":
        linear = output_projection_of(decoder)
        digest = hashlib.sha256()
        # fp16 bytes: the same model in fp32 or converted with --fp16 gives the same hash
        for tensor in (linear.weight, linear.bias):
            if tensor is not None:
                digest.update(tensor.detach().to("cpu", torch.float16).contiguous().numpy().tobytes())
        vocab_size, hidden_size = linear.weight.shape
        return cls(int(vocab_size), int(hidden_size), digest.hexdigest())

    def differences(self, other: "ModelFingerprint") -> List[str]:
        return [
            f"{name} {getattr(self, name)} vs {getattr(other, name)}"
            for name in ("vocab_size", "hidden_size", "projection_sha256")
            if getattr(self, name) != getattr(other, name)
        ]


def output_projection_of(decoder) -> torch.nn.Linear:
    """The decoder's vocabulary projection; refuses decoders that project otherwise."""
    if getattr(decoder, "adaptive_softmax", None) is not None:
        raise ClusterFileError("cluster projection does not support adaptive softmax decoders")
    linear = getattr(decoder, "output_projection", None)
    if not isinstance(linear, torch.nn.Linear):
        raise ClusterFileError(
            f"cluster projection needs a decoder with an nn.Linear output_projection "
            f"(fairseq transformer decoders); {type(decoder).__name__} has none"
        )
    return linear


@dataclass
class ClusterFile:
    centroids: Tensor  # (clusters, hidden) float32
    centroid_sqnorms: Tensor  # (clusters,) float32
    offsets: Tensor  # (clusters + 1,) long
    tokens: Tensor  # (nnz,) long
    fingerprint: ModelFingerprint
    top_k: int
    states: int  # number of decoder states that were clustered
    source_lang: Optional[str] = None  # None for scope "target" (and in files made without languages)
    target_lang: Optional[str] = None
    training: Dict[str, object] = field(default_factory=dict)  # plain values: how the file was made
    scope: str = "direction"  # "direction": one source and target language; "target": one target language
    outside_intercepts: Optional[Tensor] = None  # (clusters,) float32: outside_mass.py's estimate, where made
    outside_gradients: Optional[Tensor] = None  # (clusters, hidden) float32

    @property
    def has_outside_estimate(self) -> bool:
        return self.outside_intercepts is not None and self.outside_gradients is not None

    @classmethod
    def build(cls, centroids: Tensor, token_lists_or_csr, fingerprint: ModelFingerprint, **metadata):
        """A cluster file from centroids (clusters, hidden) and either one token list per
        cluster or a ``ClusterActiveSets``; squared norms are computed here."""
        active_sets = token_lists_or_csr
        if not isinstance(active_sets, ClusterActiveSets):
            active_sets = ClusterActiveSets.from_lists([sorted(set(t)) for t in token_lists_or_csr])
        centroids = centroids.detach().to("cpu", torch.float32).contiguous()
        return cls(
            centroids, centroids.pow(2).sum(dim=1), active_sets.offsets.cpu(), active_sets.tokens.cpu(),
            fingerprint, **metadata,
        )

    @property
    def num_clusters(self) -> int:
        return self.centroids.size(0)

    def active_sets(self) -> ClusterActiveSets:
        return ClusterActiveSets(self.offsets, self.tokens)

    def cluster_tokens(self, cluster: int) -> Tensor:
        return self.tokens[self.offsets[cluster]: self.offsets[cluster + 1]]

    # ---- checks ---------------------------------------------------------------------
    def validate(self, eos: Optional[int] = None):
        """Raise ClusterFileError on any inconsistency; ``eos`` must then be in every set."""
        vocab_size, hidden_size = self.fingerprint.vocab_size, self.fingerprint.hidden_size
        clusters = self.num_clusters
        problems = []
        if self.centroids.dim() != 2 or self.centroids.size(1) != hidden_size or clusters < 1:
            problems.append(f"centroids have shape {tuple(self.centroids.shape)}, expected (clusters >= 1, {hidden_size})")
        if not torch.isfinite(self.centroids).all():
            problems.append("centroids contain inf or nan")
        if self.centroid_sqnorms.shape != (clusters,) or not torch.allclose(
            self.centroid_sqnorms, self.centroids.pow(2).sum(dim=1), rtol=1e-4, atol=1e-6
        ):
            problems.append("centroid_sqnorms are not the squared norms of the centroids")
        problems += _csr_problems(self.offsets, self.tokens, clusters, vocab_size)
        if not 1 <= self.top_k <= vocab_size:
            problems.append(f"top_k {self.top_k} is outside [1, vocabulary size {vocab_size}]")
        if self.states and clusters > self.states:
            problems.append(f"{clusters} clusters from only {self.states} states")
        problems += self._scope_problems() + self._estimate_problems()
        if eos is not None and not problems:
            lacking = [c for c in range(clusters) if not self.cluster_tokens(c).eq(eos).any()]
            if lacking:
                problems.append(f"{len(lacking)} clusters (first: {lacking[0]}) lack eos; decoding could never stop")
        if problems:
            raise ClusterFileError("invalid cluster file: " + "; ".join(problems))

    def _scope_problems(self) -> List[str]:
        if self.scope not in SCOPES:
            return [f"scope {self.scope!r} is none of {', '.join(SCOPES)}"]
        if self.scope == "target" and (self.source_lang is not None or self.target_lang is None):
            return [f"a file of scope target names a target language and no source language, "
                    f"got source {self.source_lang!r}, target {self.target_lang!r}"]
        return []

    def _estimate_problems(self) -> List[str]:
        if self.outside_intercepts is None and self.outside_gradients is None:
            return []
        clusters, hidden = self.num_clusters, self.fingerprint.hidden_size
        if not self.has_outside_estimate or self.outside_intercepts.shape != (clusters,) \
                or self.outside_gradients.shape != (clusters, hidden):
            return [f"the outside-mass estimate must hold ({clusters},) intercepts and ({clusters}, {hidden}) "
                    f"gradients"]
        if not (torch.isfinite(self.outside_intercepts).all() and torch.isfinite(self.outside_gradients).all()):
            return ["the outside-mass estimate contains inf or nan"]
        return []

    def serves(self) -> str:
        """What the file serves, in words: ``direction en-fr`` or ``target language fr (any source)``."""
        if self.scope == "target":
            return f"target language {self.target_lang} (any source)"
        if self.source_lang is None and self.target_lang is None:
            return "one direction (languages not recorded)"
        return f"direction {self.source_lang}-{self.target_lang}"

    def check_direction(self, source_lang: Optional[str], target_lang: Optional[str], path="cluster file"):
        """Refuse a file made for another direction (scope ``direction``) or target language (either
        scope) than the run's; a language that the file or the run does not name is not compared."""
        def differ(mine, run):
            return mine is not None and run is not None and mine != run

        other_source = self.scope == "direction" and differ(self.source_lang, source_lang)
        if differ(self.target_lang, target_lang) or other_source:
            raise ClusterFileError(
                f"{path} holds the clusters of {self.serves()}; this run translates {source_lang}-{target_lang}: "
                f"give the file of that direction or of its target language, or a directory of "
                f"fastgen-train-clusters that has one"
            )

    def check_model(self, decoder, path="cluster file"):
        """Refuse a file made for another model than the one ``decoder`` belongs to."""
        differences = self.fingerprint.differences(ModelFingerprint.of_decoder(decoder))
        if differences:
            raise ClusterFileError(
                f"{path} was made for another model ({', '.join(differences)}: file vs model); "
                f"run fastgen-train-clusters with this checkpoint"
            )

    # ---- I/O ------------------------------------------------------------------------------
    def metadata(self) -> Dict[str, object]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "fingerprint": asdict(self.fingerprint),
            "num_clusters": self.num_clusters,
            "top_k": self.top_k,
            "states": self.states,
            "scope": self.scope,
            "source_lang": self.source_lang,
            "target_lang": self.target_lang,
            "training": dict(self.training),
        }

    def save(self, path):
        """Write atomically (a temporary file renamed into place)."""
        self.validate()
        tensors = {name: getattr(self, name).contiguous() for name in TENSOR_NAMES + ESTIMATE_NAMES
                   if getattr(self, name) is not None}
        metadata = self.metadata()
        payload = {"metadata": metadata, "tensors": tensors, "checksum": _checksum(metadata, tensors)}
        write_atomically(Path(path), lambda f: torch.save(payload, f))

    @classmethod
    def load(cls, path) -> "ClusterFile":
        path = Path(path)
        if not path.is_file():
            raise ClusterFileError(f"cluster file {path} does not exist")
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
            raise ClusterFileError(f"cannot read cluster file {path}: the file is truncated, damaged or not a cluster "
                                   f"file ({reader_said(error)})") from error  # one line, as a checkpoint's
        metadata, tensors = _unpack(payload, path)
        fingerprint = metadata["fingerprint"]
        cluster_file = cls(
            *(tensors[name] for name in TENSOR_NAMES),
            fingerprint=ModelFingerprint(
                int(fingerprint["vocab_size"]), int(fingerprint["hidden_size"]), str(fingerprint["projection_sha256"])
            ),
            top_k=int(metadata["top_k"]),
            states=int(metadata["states"]),
            source_lang=metadata["source_lang"],
            target_lang=metadata["target_lang"],
            training=dict(metadata["training"]),
            scope=metadata.get("scope", "direction"),
            **{name: tensors[name] for name in ESTIMATE_NAMES if name in tensors},
        )
        if cluster_file.num_clusters != metadata["num_clusters"]:
            raise ClusterFileError(f"cluster file {path}: metadata says {metadata['num_clusters']} clusters, "
                                   f"centroids hold {cluster_file.num_clusters}")
        try:
            cluster_file.validate()
        except ClusterFileError as error:
            raise ClusterFileError(f"{path}: {error}") from error
        return cluster_file


def _unpack(payload, path):
    if not isinstance(payload, dict) or not isinstance(payload.get("metadata"), dict):
        raise ClusterFileError(f"{path} is not a cluster file of fastgen-train-clusters")
    metadata = payload["metadata"]
    if metadata.get("format") != FORMAT_NAME:
        raise ClusterFileError(f"{path} is not a cluster file of fastgen-train-clusters")
    if metadata.get("version") not in READABLE_VERSIONS:
        raise ClusterFileError(
            f"{path} has cluster file format version {metadata.get('version')}; this fairseq_fastgen reads "
            f"version {FORMAT_VERSION}: rebuild it with fastgen-train-clusters"
        )
    tensors = payload.get("tensors")
    if not isinstance(tensors, dict) or any(not isinstance(tensors.get(n), Tensor) for n in TENSOR_NAMES) or any(
            not isinstance(tensors[n], Tensor) for n in ESTIMATE_NAMES if n in tensors):
        raise ClusterFileError(f"cluster file {path} lacks some of the tensors {', '.join(TENSOR_NAMES)}")
    if payload.get("checksum") != _checksum(metadata, tensors):
        raise ClusterFileError(f"cluster file {path} is corrupted (checksum mismatch)")
    return metadata, tensors


def _checksum(metadata, tensors) -> str:
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for name in TENSOR_NAMES + tuple(name for name in ESTIMATE_NAMES if name in tensors):
        tensor = tensors[name]
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _csr_problems(offsets: Tensor, tokens: Tensor, clusters: int, vocab_size: int) -> List[str]:
    if offsets.dtype != torch.long or tokens.dtype != torch.long:
        return [f"offsets and tokens must be int64, got {offsets.dtype} and {tokens.dtype}"]
    if offsets.shape != (clusters + 1,) or tokens.dim() != 1:
        return [f"offsets have shape {tuple(offsets.shape)} for {clusters} clusters"]
    problems = []
    if offsets[0] != 0 or offsets[-1] != tokens.numel() or offsets.diff().lt(0).any():
        problems.append("offsets must rise from 0 to the number of tokens")
    elif tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab_size):
        problems.append(f"token ids outside the vocabulary [0, {vocab_size})")
    elif offsets.diff().eq(0).any():
        problems.append(f"{int(offsets.diff().eq(0).sum())} clusters have an empty active set")
    return problems
