"""turnkv/torch_import.py: ``import torch`` without its Python meta kernels (serve's start-up),
and the real module afterwards, after which the process has what a plain ``import torch`` gives:
meta tensors, FakeTensor and ``torch.compile`` work, the same meta kernels registered."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from turnkv import torch_import

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Code run in a fresh interpreter after torch is in. OP runs an op whose only meta kernel is one
# of torch._meta_registrations' Python ones (none in C++): on the meta device it needs the real
# module. STATE prints what a plain import registers: the ops with a Meta kernel in the dispatcher
# and the sizes of the decomposition tables.
OP = ("def op(device):\n"
      "    x = torch.ones(4, 3, device=device)\n"
      "    return tuple(torch.cdist(x, x).shape)\n")
STATE = (
    "import torch._decomp\n"
    "names = torch._C._dispatch_get_all_op_names()\n"
    "metas = sum(torch._C._dispatch_has_kernel_for_dispatch_key(n, 'Meta') for n in names)\n"
    "tables = {k: len(v) for k, v in sorted(torch._decomp.global_decomposition_table.items())}\n"
    "print('state', metas, tables)\n")
TRACING = (
    "from torch._subclasses.fake_tensor import FakeTensorMode\n"
    "with FakeTensorMode():\n"
    "    fake = torch.cdist(torch.ones(5, 2), torch.ones(7, 2))\n"
    "f, a = lambda a: torch.cdist(a, a).sum() * 2, torch.arange(6.0).view(3, 2)\n"
    "print('tracing', tuple(fake.shape), float(torch.compile(f, backend='eager')(a)) == float(f(a)))\n")


def _run(code: str, timeout: float = 600) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


MODULES = "import sys\nprint('modules', *sorted(sys.modules))\n"


def test_a_lean_import_leaves_the_meta_kernels_out_until_complete_brings_them_all():
    lean, plain = _run(
        "import sys\n"
        "from turnkv import torch_import\n"
        "print(torch_import.import_lean(), torch_import.imported_lean(), torch_import.deferred())\n"
        "import torch\n"
        + MODULES + OP +
        "print(float(torch.arange(4.0).sum()), op('cpu'), *(m in sys.modules for m in\n"
        "      ('torch._meta_registrations', 'torch._decomp', 'torch._refs', 'torch._prims')),\n"
        "      hasattr(torch, '_meta_registrations'))\n"
        "try:\n"
        "    print(op('meta'))\n"
        "except NotImplementedError:\n"
        "    print('no meta kernel')\n"
        "torch_import.complete()\n"
        "real = sys.modules['torch._meta_registrations']\n"
        "print(torch_import.deferred(), torch._meta_registrations is real, hasattr(real, 'activate_meta'), op('meta'))\n"
        + STATE + TRACING), _run("import torch\n" + MODULES + OP + "print(op('meta'))\n" + STATE + TRACING)
    assert lean[0] == "True True True"
    assert lean[2:4] == ["6.0 (4, 4) False False False False False", "no meta kernel"]
    assert lean[4] == "False True True (4, 4)" and plain[1] == "(4, 4)"
    # the same meta kernels and decompositions registered as a plain import's, and tracing works
    assert lean[5:] == plain[2:]
    assert plain[2].startswith("state ") and plain[3] == "tracing (5, 7) True"
    # what the lean import left out: the meta kernels and what a plain import brings only through them
    left_out = set(plain[0].split()[1:]) - set(lean[1].split()[1:])
    roots = {m for m in left_out if m.rpartition(".")[0] not in left_out}
    assert roots == {torch_import.META, *torch_import.THROUGH_META}


@pytest.mark.parametrize("first", ["import torch._decomp", "import torch._refs", "import torch.utils._content_store",
                                   TRACING])
def test_a_first_import_of_what_the_meta_kernels_bring_imports_them_first(first):
    """Before ``complete``, a first import of a module a plain import brings in only through the
    meta kernels (``torch._decomp`` fails on its own: a circle that only torch's order resolves)
    imports them first; the process then has a plain import's meta kernels and decompositions,
    and ``complete`` has nothing left to do."""
    lean = _run("from turnkv import torch_import\n"
                "torch_import.import_lean()\n"
                "import torch\n" + first + "\n"
                "print(torch_import.deferred())\n" + OP + "print(op('meta'))\n" + STATE + TRACING)
    plain = _run("import torch\n" + first + "\n" + STATE + TRACING)
    assert lean[-4:-2] == ["False", "(4, 4)"] and lean[-2:] == plain[-2:]


def test_import_lean_leaves_a_process_that_has_torch_alone():
    import torch

    assert torch_import.import_lean() is False
    assert not torch_import.imported_lean() and not torch_import.deferred()
    assert hasattr(sys.modules[torch_import.META], "activate_meta")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A real `turnkv serve` in this interpreter (the main thread serves); a thread waits for its first
# answer, then for the meta kernels' thread, checks meta and tracing, and stops the server.
SERVE = (
    "import http.client, os, signal, sys, threading, time\n"
    "from turnkv import cli, torch_import\n"
    "port, seen = int(sys.argv[1]), []\n"
    "def answers():\n"
    "    try:\n"
    "        conn = http.client.HTTPConnection('127.0.0.1', port, timeout=5)\n"
    "        conn.request('GET', '/v1/models')\n"
    "        return conn.getresponse().status == 200\n"
    "    except OSError:\n"
    "        return False\n"
    "def check():\n"
    "    try:\n"
    "        while not answers():\n"
    "            time.sleep(0.05)\n"
    "        seen.append(torch_import.imported_lean())\n"
    "        for thread in threading.enumerate():\n"
    "            if thread.name == 'turnkv-torch-meta-kernels':\n"
    "                thread.join(300)\n"
    "        import torch\n"
    "        seen.append(torch_import.deferred())\n"
    "        seen.append(hasattr(sys.modules['torch._meta_registrations'], 'activate_meta'))\n"
    "        seen.append(tuple(torch.cdist(torch.ones(2, 3, device='meta'), torch.ones(5, 3, device='meta')).shape))\n"
    "    finally:\n"
    "        os.kill(os.getpid(), signal.SIGTERM)\n"
    "threading.Thread(target=check, daemon=True).start()\n"
    "code = cli.main(['serve', '-m', 'smollm2-135m', '--port', str(port), '--max-context', '512'])\n"
    "print(code, *seen)\n")


def test_serve_imports_torch_lean_and_the_real_meta_kernels_once_it_answers():
    from turnkv.loading.bundled import find_bundled

    if not find_bundled("smollm2-135m")[0]:
        pytest.skip("bundled model smollm2-135m is not installed")
    out = subprocess.run([sys.executable, "-c", SERVE, str(_free_port())], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1:] == ["0 True False True (2, 5)"], out.stderr[-3000:]
