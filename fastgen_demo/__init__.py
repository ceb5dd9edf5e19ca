"""The demo and the toy models: ``make demo`` and the test fixtures, kept out of the plugin.

fairseq imports ``fairseq_fastgen`` (``--user-dir``); nothing there imports this
package.  It holds the embedded synthetic corpus (:mod:`.synthetic`, and
:mod:`.multi_source` with a second source language), the pipeline that binarizes
it and trains tiny models with the real fairseq tools (:mod:`.toy`,
:mod:`.toy_multilingual`) and ``make demo`` (:mod:`.demo`).
"""
