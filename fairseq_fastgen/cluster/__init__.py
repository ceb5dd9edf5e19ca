"""Cluster-projected vocabulary: ``fastgen-train-clusters`` and ``--cluster-projection``.

``train`` builds a cluster file from a model's decoder states (faiss k-means),
``clusterfile`` reads, writes and checks it, ``projection`` applies it at
every decoding step. Imported lazily: faiss is needed only to train.
"""
