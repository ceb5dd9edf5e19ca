"""The multilingual models of ``fastgen-train-clusters``: fairseq's ``translation_multi_simple_epoch``.

Such a model is one shared transformer trained on ``--lang-pairs``; its task
marks the source with a language token (``--encoder-langtok``) and forces a
target language token first in the decoder (``--decoder-langtok``). Its
states are recorded one direction at a time, with the task set up as
fairseq-generate sets it up for ``--source-lang SRC --target-lang TGT``.
"""

import copy
from typing import List, Tuple

from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask


def is_multilingual(task) -> bool:
    return isinstance(task, TranslationMultiSimpleEpochTask)


def model_directions(task) -> List[Tuple[str, str]]:
    """(source, target) of every pair of the model's ``--lang-pairs``, in their order."""
    return [tuple(pair.split("-")) for pair in task.args.lang_pairs]


def direction_task(task, source_lang: str, target_lang: str) -> TranslationMultiSimpleEpochTask:
    """The model's task set up for one direction, as for decoding it (its splits hold that pair only)."""
    args = copy.deepcopy(task.args)
    args.source_lang, args.target_lang = source_lang, target_lang
    return type(task).setup_task(args)


def target_language_tokens(task, target_lang: str) -> List[int]:
    """The token the decoder is forced to start with for ``target_lang`` (none without ``--decoder-langtok``):
    every cluster keeps it, since a forced token outside the active set would score -inf."""
    _, target_spec = task.args.langtoks["main"]
    return [task.data_manager.get_decoder_langtok(target_lang, target_spec)] if target_spec else []
