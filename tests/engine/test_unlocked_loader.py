"""The compiled units' loader releases Python's GIL while a unit runs (engine/unlocked_loader.py): another thread
of the process runs beside a unit's call, where torch's own loader stops it; both give the same bits."""

import sys
import threading
import time

import pytest
import torch

from fairseq_fastgen.engine import loaded_package, unlocked_loader


class TanhProducts(torch.nn.Module):
    def forward(self, x, w):  # x (rows, dim), w (dim, dim)
        for _ in range(8):
            x = torch.tanh(x @ w)
        return x


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    if unlocked_loader.loader_class() is None:
        pytest.skip("the loader that releases the GIL does not build here (no compiler)")
    torch.manual_seed(0)
    inputs = (torch.randn(256, 512), torch.randn(512, 512) / 24)
    path = tmp_path_factory.mktemp("unit") / "tanh_products.pt2"
    torch._inductor.aoti_compile_and_package(torch.export.export(TanhProducts(), inputs), package_path=str(path))
    return path, inputs


def runs_of_another_thread_during(call, calls: int = 20) -> int:
    """How often a second thread ran while this one called ``call`` ``calls`` times, with a switch interval so long
    that the second thread runs only where a call gives the GIL up."""
    ran, done = [0], threading.Event()

    def other():
        while not done.is_set():
            ran[0] += 1
            time.sleep(0)  # gives the GIL up, then waits for it

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=other)
    thread.start()
    try:
        while not ran[0]:
            time.sleep(0.001)
        sys.setswitchinterval(60.0)
        time.sleep(0.01)  # the other thread's next waits for the GIL are under the long interval
        before = ran[0]
        for _ in range(calls):
            call()
        return ran[0] - before
    finally:
        sys.setswitchinterval(interval)
        done.set()
        thread.join()


def test_a_units_call_lets_other_threads_run_and_gives_torchs_bits(package):
    path, inputs = package
    unit = loaded_package.load_package(path)
    assert isinstance(unit.loader, unlocked_loader.loader_class())
    torchs = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    (expected,) = torchs.boxed_run(list(inputs))
    assert expected.shape == (256, 512) and torch.equal(unit(*inputs), expected)

    # torch's binding gives the GIL up about once a call, outside the compiled code (measured: 15-20 times in 20
    # calls); around the compiled code the other thread runs again and again (about 900 times a call)
    assert runs_of_another_thread_during(lambda: torchs.boxed_run(list(inputs))) <= 40
    assert runs_of_another_thread_during(lambda: unit(*inputs)) > 200
