"""The plugin's changes to objects fairseq built, each beside its undo.

With :mod:`fairseq_fastgen.integration` (the patches of fairseq's modules, at
import) and the four adapters of FastSeq's optimizations (``fastseq/beam_loop.py``,
``shared_cache.py``, ``shared_prompt.py``, ``ngram.py``), these modules are the
integration layer: the only code that assigns to fairseq's objects
(``tests/test_fairseq_assignments.py`` checks the source).  Every other module
asks them.

* :mod:`.generate`: a generator's ``generate`` run inside a context (inference
  mode, oneDNN's products, the cluster projection, the run's batch output), and
  the attributes the plugin gives a generator;
* :mod:`.ensemble`: fairseq's ``EnsembleModel`` of a generator replaced (the step
  engine's), or its decoder steps observed;
* :mod:`.output_layer`: a decoder's vocabulary projection through the cluster
  projection while a stock generator generates;
* :mod:`.linear_forwards`: a model's linear layers through oneDNN's packed product.

:func:`fairseq_fastgen.integration.restore_stock_generator` undoes them all on a
``--decoder beam`` generator.
"""
