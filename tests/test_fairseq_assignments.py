"""The integration seam, checked on the source: only the integration layer assigns to fairseq's objects.

fairseq has no extension point for most of what the plugin changes, so it changes fairseq's modules and the
objects fairseq builds; all of it lives in the integration layer, each change with its undo
(``integration.restore_stock_generator``, ``tests/fastseq/test_restore_stock.py``):

- ``integration.py``: the patches of fairseq's modules, made at import;
- ``adapters/``: the changes to a generator fairseq built, its ensemble and its models' modules;
- ``fastseq/beam_loop.py``, ``shared_cache.py``, ``shared_prompt.py``, ``ngram.py``: FastSeq's optimizations of
  fairseq's beam search (a generator's class, its ensemble's methods, its models' attention classes, its n-gram
  blocker).

Every other module of the package leaves fairseq's objects as they are.  The rule, on the syntax (names are
what the package calls fairseq's objects):

- fairseq objects: a name imported from fairseq (``checkpoint_utils``, ``FairseqTask``), a name of
  OBJECT_HOLDERS (``generator``, ``model``, ``decoder``, ``module``, ``linear``, ...; also as the end of a name,
  ``stock_ensemble``), and a local name bound to an attribute read through one (``positions =
  self.decoder.embed_positions``);
- an assignment to fairseq's object: ``holder.attribute = ...`` (``+=``, ``del`` too, at any depth:
  ``generator.model.forward_decoder = ...``), ``setattr``/``delattr``/``object.__setattr__`` on one, a write to
  its ``__dict__``; and, on any object but ``self``, an assignment to ``__class__`` or to a method fairseq's
  objects run (PATCHED_METHODS: ``x.forward = ...``);
- not one: ``self.attribute = ...`` in the plugin's own classes (their subclasses of fairseq's classes
  included), and assignments to an object the same function made of a plugin class (``generator =
  cls(...)``, ``ensemble = EngineEnsemble(...)``) or through ``cls`` / ``super()``.

fairseq's configuration (``cfg.generation.beam = ...``, ``args.max_tokens = ...``, CONFIG_HOLDERS) is data,
not behaviour: the plugin writes option values into it only to prepare a run's options, in the functions
OPTION_PREPARATION lists with the reason, besides the integration layer.  The exceptions to the object rule
are listed with theirs (OWN_OBJECTS).
"""

import ast
from pathlib import Path

import fairseq_fastgen

PACKAGE = Path(fairseq_fastgen.__file__).parent

INTEGRATION_LAYER = {
    "integration.py",
    "adapters/__init__.py",
    "adapters/cpu_amp.py",
    "adapters/ensemble.py",
    "adapters/generate.py",
    "adapters/inference_mode.py",
    "adapters/linear_forwards.py",
    "adapters/output_layer.py",
    "fastseq/beam_loop.py",
    "fastseq/ngram.py",
    "fastseq/shared_cache.py",
    "fastseq/shared_prompt.py",
}

OBJECT_HOLDERS = {"generator", "generators", "model", "models", "ensemble", "decoder", "encoder", "module", "modules",
                  "layer", "layers", "linear", "attention", "task", "blocker", "embed_positions"}
CONFIG_HOLDERS = {"cfg", "args", "generation", "dataset", "gen_cfg", "run_cfg"}
PATCHED_METHODS = {"__class__", "forward", "generate", "_generate", "forward_decoder", "forward_encoder",
                   "reorder_encoder_out", "reorder_incremental_state", "output_layer", "extract_features"}

# (module, function): where a run's options are prepared in fairseq's configuration, and why there
OPTION_PREPARATION = {
    ("sequence_generators/streaming.py", "prepare_streaming_cli"):
        "the streaming decoders' prepare_cli hook (registry): their pool and capacity, before fairseq batches",
    ("bench/options.py", "run_config"): "fastgen-bench: one configuration's options, on its own deep copy",
    ("bench/options.py", "steady_engine"):
        "fastgen-bench: --step-engine auto named as it runs once its units are on disk, on run_config's deep copy",
    ("bench/cluster_projection.py", "grid"): "the plugin's own k-means settings (ClusterTrainingConfig) per count",
    ("cli/async_generate.py", "async_generate_main"):
        "fairseq-generate's own default --max-tokens, as its _main sets it",
    ("cluster/multilingual.py", "direction_task"): "one direction of a multilingual task, on a deep copy of its args",
    ("distill.py", "parse"): "fastgen-distill's default --max-tokens, in the args of its own parser",
    ("serve/options.py", "parse_command_line"):
        "fastgen-serve's defaults of --batch-size and --fixed-batch-size and fairseq-interactive's --buffer-size "
        "rule, in the args of its own parser",
    ("models/transformer_khead.py", "khead_defaults"): "a registered model's defaults, fairseq's architecture idiom",
    ("models/transformer_khead.py", "KHeadTransformerModel.build_model"):
        "the warm start recorded in the model's args, so a saved checkpoint does not read the base again",
    ("tasks/translation_distill.py", "TranslationDistillTask._load_from"):
        "the plugin's task reads another data directory through its own cfg, restored on exit",
}
# (module, function): fairseq objects assigned outside the integration layer, and why that is no change to fairseq
OWN_OBJECTS = {
    ("models/transformer_khead.py", "KHeadTransformerModel.build_model"):
        "the plugin's model gives its own decoder (KHeadTransformerDecoder) its k heads while it is built",
    ("serve/batching.py", "ContinuousBatching.run"):
        "the plugin's own generator (sequence_generators/generator.py) is handed the server's stream, as "
        "fairseq-interactive's lines hand it theirs (integration.py), and takes it back after",
    ("serve/batching.py", "ContinuousBatching.__init__"):
        "the plugin's own stream scheduler (sequence_generators/streaming.py) of the served stream: its refill "
        "point where --stream-eps was not given",
    ("engine/decoder_step.py", "position_table"):
        "grows a sinusoidal position table as fairseq's own forward grows it (the same values, a cache); the "
        "encoder's and decoder's forms of the engine read their tables through it",
}


def chain(node):
    """Names along an attribute chain, outermost first: ``self.decoder.heads`` -> [self, decoder, heads]; a call
    or subscript in the chain shows as ``()`` / ``[]`` (``super().x`` -> [super, (), x])."""
    names = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            names.append("()")
            node = node.func
        elif isinstance(node, ast.Subscript):
            names.append("[]")
            node = node.value
        else:
            break
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def is_holder(name: str, holders) -> bool:
    return name in holders or any(name.endswith("_" + holder) for holder in holders)


def fairseq_imports(tree) -> set:
    """Names a module binds to fairseq's modules and classes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("fairseq", "fairseq_cli"):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                         if alias.name.split(".")[0] in ("fairseq", "fairseq_cli"))
    return names


class Assignments(ast.NodeVisitor):
    """(function, line, kind, target) of every assignment to a fairseq object (kind "object") or configuration
    (kind "config") in one module."""

    def __init__(self, fairseq_names):
        self.fairseq_names = fairseq_names
        self.scopes = []  # enclosing class and function names
        self.own = [set()]  # per function: names bound to objects it made of a plugin class
        self.aliases = [set()]  # per function: names bound to an attribute read through a fairseq object
        self.found = []

    def scope(self) -> str:
        return ".".join(self.scopes)

    def visit_ClassDef(self, node):
        self.scopes.append(node.name)
        self.generic_visit(node)
        self.scopes.pop()

    def visit_FunctionDef(self, node):
        self.scopes.append(node.name)
        self.own.append(set())
        self.aliases.append(set())
        self.generic_visit(node)
        self.aliases.pop()
        self.own.pop()
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def holds_object(self, name) -> bool:
        return name in self.fairseq_names or is_holder(name, OBJECT_HOLDERS) or name in self.aliases[-1]

    def kind(self, names):
        """"object", "config" or None for an assignment to the attribute chain ``names`` (its last name assigned)."""
        root, through = names[0], names[:-1]
        if root in self.own[-1] or root in ("cls", "super"):
            return None
        if root == "self":
            through = through[1:]  # the plugin's own object: only what it reaches counts
        elif names[-1] in PATCHED_METHODS:
            return "object"
        if any(self.holds_object(name) for name in through):
            return "object"
        if any(is_holder(name, CONFIG_HOLDERS) for name in through):
            return "config"
        return None

    def record(self, node, names):
        kind = self.kind(names) if names else None
        if kind:
            self.found.append((self.scope(), node.lineno, kind, ".".join(names)))

    def visit_target(self, node, target):
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.visit_target(node, element)
        elif isinstance(target, ast.Attribute):
            self.record(node, chain(target))
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute) \
                and target.value.attr == "__dict__":
            names = chain(target.value)
            if names and names[0] != "self":  # another object's attributes written past its __setattr__
                self.found.append((self.scope(), node.lineno, "object", ".".join(names) + "[]"))

    def bind(self, target, value):
        """Track what a local name holds: an object made here of a plugin class, or a part of a fairseq object."""
        if not isinstance(target, ast.Name):
            return
        self.own[-1].discard(target.id)
        self.aliases[-1].discard(target.id)
        names = chain(value)
        if isinstance(value, ast.Call) and names and names[0] not in self.fairseq_names and (
                names[0] in ("cls", "super") or names[0][:1].isupper()):
            self.own[-1].add(target.id)
        elif isinstance(value, (ast.Attribute, ast.Subscript)) and names and names[0] not in self.own[-1] and any(
                self.holds_object(name) for name in names[:-1]):
            self.aliases[-1].add(target.id)

    def visit_Assign(self, node):
        for target in node.targets:
            self.visit_target(node, target)
            self.bind(target, node.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self.visit_target(node, node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        self.visit_target(node, node.target)
        if node.value is not None:
            self.bind(node.target, node.value)
        self.generic_visit(node)

    def visit_Delete(self, node):
        for target in node.targets:
            self.visit_target(node, target)
        self.generic_visit(node)

    def visit_Call(self, node):
        names, args = chain(node.func), list(node.args)
        if names and names[-1] in ("__setattr__", "__delattr__") and names[:-1] != ["object"]:
            args = [node.func.value] + args  # x.__setattr__(name, value)
        if names and names[-1] in ("setattr", "delattr", "__setattr__", "__delattr__") and len(args) > 1:
            name = args[1].value if isinstance(args[1], ast.Constant) else "*"
            self.record(node, chain(args[0]) + [str(name)])
        self.generic_visit(node)


def assignments(source: str):
    tree = ast.parse(source)
    visitor = Assignments(fairseq_imports(tree))
    visitor.visit(tree)
    return visitor.found


def test_only_the_integration_layer_assigns_to_fairseq_objects():
    modules = {p.relative_to(PACKAGE).as_posix(): p for p in sorted(PACKAGE.rglob("*.py"))}
    assert INTEGRATION_LAYER <= set(modules)  # the layer as listed exists
    assert {m for m in modules if m.startswith("adapters/")} <= INTEGRATION_LAYER  # every adapter is listed
    allowed = {"config": set(OPTION_PREPARATION), "object": set(OWN_OBJECTS)}
    offending, used = {}, set()
    for name, path in modules.items():
        if name in INTEGRATION_LAYER:
            continue
        for function, line, kind, target in assignments(path.read_text()):
            if (name, function) in allowed[kind]:
                used.add((kind, name, function))
            else:
                offending.setdefault(name, []).append((line, function, target))
    assert offending == {}
    listed = {("config", *key) for key in OPTION_PREPARATION} | {("object", *key) for key in OWN_OBJECTS}
    assert listed - used == set()  # no stale exception


def test_the_rule_sees_assignments_to_fairseq_objects():
    """What the rule catches and what it lets pass, on snippets of the patterns the package had."""
    found = assignments(
        "from fairseq import checkpoint_utils\n"
        "def patch(generator, models, decoder, linear, module, wrapper, ensemble):\n"
        "    generator.generate = wrapper\n"  # 3: a replaced method
        "    decoder.output_layer = wrapper\n"  # 4
        "    linear.__dict__['forward'] = wrapper\n"  # 5: past nn.Module's setattr
        "    module.__class__ = type(module)\n"  # 6: a class swap
        "    generator.model.forward_decoder = wrapper\n"  # 7: through the generator
        "    setattr(models[0], 'x', 1)\n"  # 8
        "    del decoder.output_layer\n"  # 9
        "    checkpoint_utils.load_checkpoint_to_cpu = wrapper\n"  # 10: a fairseq module's name
        "    stock_ensemble = ensemble\n"
        "    stock_ensemble.x = 1\n"  # 12: a holder's name at the end of a name
        "    positions = self.decoder.embed_positions\n"
        "    positions.weights = None\n"  # 14: a part of a fairseq object
        "    anything.forward = wrapper\n"  # 15: a method fairseq's objects run, on any object
        "    cfg.generation.beam = 5\n"  # 16: configuration
        "    self.generator = generator\n"  # 17: the plugin's own attribute
        "    self.decoder.heads = None\n"  # 18: a fairseq object the plugin's object holds
        "    made = EngineEnsemble(models)\n"
        "    made.stock_ensemble = ensemble\n"  # 20: an object made here of a plugin class
        "    generator = cls(models)\n"
        "    generator.nbest = 2\n"  # 22: likewise
        "    state.tokens = None\n"  # 23: the plugin's data
    )
    assert [(line, kind) for _, line, kind, _ in found] == [
        (3, "object"), (4, "object"), (5, "object"), (6, "object"), (7, "object"), (8, "object"), (9, "object"),
        (10, "object"), (12, "object"), (14, "object"), (15, "object"), (16, "config"), (18, "object")]
