"""``python -m fairseq_fastgen.bench``: the same as the fastgen-bench console script."""

from fairseq_fastgen.bench import cli_main

cli_main()
