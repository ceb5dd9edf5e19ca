"""The runner seam, checked on the source: no module under sequence_generators/, in any subfolder, calls the model.

Decoders (policies, schedulers, states, processors) ask their runner (``engine/``: fairseq's incremental
decoder, the static and the compiled engine) for every model computation (``encode``, ``step``, ``step_block``,
``project``, ``heads``, the int8 proposals) and for the model's facts (``max_target_positions``,
``identity_first_head``), so that an engine is one more runner and decoders never know which engine runs their
steps.  A call whose callee is reached through a ``model``, ``decoder`` or ``encoder`` attribute or name
(``self.decoder.heads(x)``, ``model.decoder.forward_block(...)``, ``decoder(...)``), or a call of a forward method
by name, is model work; reading attributes, the length queries and switching to evaluation mode are not.
"""

import ast
from pathlib import Path

import fairseq_fastgen.sequence_generators as package

MODEL_HOLDERS = {"model", "models", "decoder", "encoder"}
FORWARDS = {"forward", "forward_block", "forward_torchscript", "extract_features", "output_layer",
            "get_normalized_probs", "forward_decoder", "forward_encoder"}
QUERIES = {"max_positions", "max_decoder_positions", "max_source_positions", "eval"}  # lengths, mode: no computation


def chain(node):
    """Names along an attribute chain, outermost first: ``self.decoder.heads`` -> [self, decoder, heads]."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def model_calls(source: str):
    """(line, callee) of every call in ``source`` that runs part of the model."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        names = chain(node.func)
        if not names:
            continue
        through_model = any(name in MODEL_HOLDERS for name in names)
        if names[-1] in FORWARDS or (through_model and names[-1] not in QUERIES):
            found.append((node.lineno, ".".join(names)))
    return found


def test_only_the_runner_calls_the_model():
    directory = Path(package.__file__).parent
    modules = sorted(directory.rglob("*.py"))
    assert len(modules) > 10 and directory / "blockwise" / "policy.py" in modules
    offending = {str(p.relative_to(directory)): model_calls(p.read_text()) for p in modules}
    assert {name: calls for name, calls in offending.items() if calls} == {}


def test_the_rule_sees_model_calls():
    """What the rule catches and what it lets pass, on snippets."""
    calls = model_calls(
        "h = self.decoder.heads(x)\n"
        "f = model.decoder.forward_block(t, p, e, c)\n"
        "y = decoder(x)\n"
        "z = self.whatever.extract_features(x)\n"
        "n = self.decoder.max_positions()\n"
        "self.model.eval()\n"
        "k = self.decoder.heads.identity_first\n"
        "s = ctx.runner.step(t, e, c)\n"
    )
    assert [line for line, _ in calls] == [1, 2, 3, 4]
