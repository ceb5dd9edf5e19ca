"""What fairseq loads with ``--user-dir fairseq_fastgen`` stays the plugin: no module of it imports the demo and
toy-model package (``fastgen_demo``), which ``make demo`` and the test fixtures use beside it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# fairseq's way in (--user-dir), then every module of the package, as the console scripts and the bench import them
LOAD_THE_PLUGIN = """
import argparse, importlib, json, pkgutil, sys
from fairseq import utils
from fairseq.dataclass import configs
utils.import_user_module(argparse.Namespace(user_dir=sys.argv[1]))
import fairseq_fastgen
from fairseq_fastgen.registry import DECODERS
modules = [info.name for info in pkgutil.walk_packages(fairseq_fastgen.__path__, "fairseq_fastgen.")
           if not info.name.endswith("__main__")]
for name in modules:
    importlib.import_module(name)
print(json.dumps({
    "plugin": fairseq_fastgen.__file__,
    "modules": len(modules),
    "decoders": sorted(DECODERS),
    "generation_fields": "decoder" in configs.GenerationConfig.__dataclass_fields__,
    "demo_modules": sorted(m for m in sys.modules if m.split(".")[0] == "fastgen_demo"),
}))
"""


def test_the_plugin_and_every_module_of_it_load_without_the_demo_package():
    plugin_dir = REPO / "fairseq_fastgen"
    completed = subprocess.run([sys.executable, "-c", LOAD_THE_PLUGIN, str(plugin_dir)], cwd=REPO,
                               capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    loaded = json.loads(completed.stdout.splitlines()[-1])
    assert Path(loaded["plugin"]).parent == plugin_dir  # this checkout's plugin, not an installed copy
    assert loaded["modules"] > 50 and {"beam", "greedy", "blockwise", "var-stream"} <= set(loaded["decoders"])
    assert loaded["generation_fields"]  # the registrations ran: --decoder is one of fairseq's generation options
    assert loaded["demo_modules"] == []


READ_THE_CAP = "import os, fairseq_fastgen; print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'))"


def test_the_plugin_caps_onednns_primitive_cache_unless_the_user_set_it():
    """integration.py, 7: oneDNN keeps 32 primitives (not 1024) unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is set."""
    for given, expected in ((None, "32"), ("200", "200")):
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
        if given is not None:
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = given
        completed = subprocess.run([sys.executable, "-c", READ_THE_CAP], cwd=REPO, env=env, capture_output=True,
                                   text=True)
        assert completed.returncode == 0, completed.stderr[-3000:]
        assert completed.stdout.split()[-1] == expected


CONSOLE_SCRIPTS = ("fastgen-bench", "fastgen-distill", "fastgen-train-clusters")  # setup.py's


def test_the_console_scripts_print_no_noise_of_fairseqs(tmp_path):
    """Fairseq's "Please install tensorboardX" INFO line (its text_to_speech task, imported with
    every task) was the first line of each of the plugin's console scripts, --help included."""
    entry_points = (REPO / "setup.py").read_text()
    for name in CONSOLE_SCRIPTS:
        assert f'"{name}=' in entry_points
        script = Path(sys.executable).parent / name
        module = re.search(rf'"{name}=([\w.]+):cli_main"', entry_points).group(1)
        command = [str(script)] if script.exists() else [sys.executable, "-c", f"from {module} import cli_main; "
                                                                               f"cli_main()"]
        result = subprocess.run(command + ["--help"], capture_output=True, text=True, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stderr == "", f"{name} --help: {result.stderr[-2000:]}"
