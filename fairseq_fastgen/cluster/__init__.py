"""Cluster-projected vocabulary: ``fastgen-train-clusters`` and ``--cluster-projection``.

``train`` builds a cluster file from a model's decoder states (faiss k-means),
``clusterfile`` reads, writes and checks it, ``projection`` applies it at
every decoding step. A multilingual model's files (one per direction or per
target language) share a directory: ``directory`` writes its index and picks
a run's file, ``multilingual`` sets fairseq's multilingual task up per
direction. Imported lazily: faiss is needed only to train.
"""
